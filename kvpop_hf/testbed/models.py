"""Loading a model for the evaluation: ``--model`` and every policy that brings its own weights."""

from __future__ import annotations

__all__ = ["load_model"]


def load_model(path: str, dtype, device):
    """The causal LM at ``path`` in ``dtype`` on ``device``, in eval mode, with the ``kvpop`` attention (every
    query of a prompt chunk sees exactly its own fixed-budget set; stock attention would not)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvpop", dtype=dtype).to(device).eval()
