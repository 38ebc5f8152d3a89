"""Loading a model for the evaluation: ``--model`` and every policy that brings its own weights."""

from __future__ import annotations

import gc

import torch

__all__ = ["load_model", "model_config", "holds_model", "LastModel"]

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter folder (LoRA weights + the base model's path)


def holds_model(path) -> bool:
    """``path`` is a model directory (``config.json``) or a PEFT adapter folder over a base model."""
    from pathlib import Path

    return (Path(path) / "config.json").is_file() or (Path(path) / ADAPTER_CONFIG).is_file()


def model_config(path):
    """The model config of a model directory, or of the base model of a PEFT adapter folder."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    adapter = Path(path) / ADAPTER_CONFIG
    if adapter.is_file() and not (Path(path) / "config.json").is_file():
        path = json.loads(adapter.read_text())["base_model_name_or_path"]
    return AutoConfig.from_pretrained(path)


def load_model(path: str, dtype, device):
    """The causal LM at ``path`` in ``dtype`` on ``device``, in eval mode, with the ``kvpop`` attention (every
    query of a prompt chunk sees exactly its own fixed-budget set; stock attention would not). A folder stored as
    a weight delta of its base model (:mod:`kvpop_lab.testbed.weight_delta`) is rebuilt from it; a PEFT adapter
    folder loads its base model with the adapter applied (transformers does this when ``peft`` is installed)."""
    from transformers import AutoModelForCausalLM

    from .weight_delta import is_weight_delta, load_weight_delta

    if is_weight_delta(path):
        return load_weight_delta(path, dtype, device)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvpop", dtype=dtype).to(device).eval()


class LastModel:
    """The most recently loaded model of a policy with its own weights (a distilled student): the runs of one
    checkpoint at several budgets, and the analysis after them, reuse it; another checkpoint replaces it, so at
    most one such model is in memory beside ``--model``."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device
        self.path: str | None = None
        self.model = None

    def get(self, path: str):
        if path != self.path:
            self.clear()
            self.model, self.path = load_model(path, self.dtype, self.device), path
        return self.model

    def clear(self) -> None:
        """Drop the held model and return its memory."""
        self.model, self.path = None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
