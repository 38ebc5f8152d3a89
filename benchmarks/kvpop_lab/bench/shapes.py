"""Model shapes of the speed benchmarks and a random-weight model of one: torch and transformers only (no kvpop_hf),
so a peer library's runner in its own environment builds the same model (``kvpop_lab.peers.speed_kvpress``)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

__all__ = ["SHAPES", "build_model"]

SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, head_dim, vocab
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
    "tiny": (128, 256, 2, 4, 2, 32, 512),
}


def build_model(shape: str, device, dtype, max_pos: int):
    """A Qwen3 causal LM of ``shape`` (a key of :data:`SHAPES`) with random weights (seed 0) on ``device`` in
    ``dtype``, sdpa attention, eval mode; ``max_pos`` positions."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(sorted(SHAPES))}")
    hidden, inter, layers, heads, kv_heads, head_dim, vocab = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.eval()
