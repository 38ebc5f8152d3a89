"""Saving a merged student in the dtype its weights came in.

A LoRA student is trained on float32 weights (the optimizer's master copy) even when the model it was made
from is stored in bfloat16, as the testbed teachers are. Merged and saved as they are, its weights take twice
the teacher's bytes. :func:`save_weights_as` writes them cast to a chosen dtype, and :func:`source_dtype` reads
the dtype that the source checkpoint records.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dtype(model_path: str) -> torch.dtype | None:
    """The dtype recorded in ``model_path``'s config (None when it records none)."""
    cfg = AutoConfig.from_pretrained(model_path)
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(d, str):
        d = DTYPES.get(d)
    return d if isinstance(d, torch.dtype) else None


def check_merged_dtype(choice: str) -> None:
    """Raise for a ``--merged_dtype`` that is neither ``source`` nor one of :data:`DTYPES` (reads nothing)."""
    if choice != "source" and choice not in DTYPES:
        raise ValueError(f"--merged_dtype must be 'source' or one of {sorted(DTYPES)}, got {choice!r}.")


def merged_dtype(choice: str, model_path: str) -> torch.dtype | None:
    """``--merged_dtype``: ``source`` (the source checkpoint's dtype), or one of :data:`DTYPES`."""
    check_merged_dtype(choice)
    return source_dtype(model_path) if choice == "source" else DTYPES[choice]


def save_weights_as(model, output_dir, dtype: torch.dtype | None) -> None:
    """``model.save_pretrained(output_dir)`` with its floating-point weights cast to ``dtype`` (None: unchanged).
    The model in memory keeps its own dtype; weights that share storage (tied embeddings) stay shared."""
    if dtype is None or dtype == model.dtype:
        model.save_pretrained(output_dir)
        return
    cast: dict[tuple, torch.Tensor] = {}

    def to_dtype(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in cast:
            cast[key] = t.detach().to(dtype)
        return cast[key]

    model.save_pretrained(output_dir, state_dict={k: to_dtype(v) for k, v in model.state_dict().items()})
    config = copy.deepcopy(model.config)  # save_pretrained records the in-memory dtype: record the saved one
    config.dtype = dtype
    config.save_pretrained(output_dir)
