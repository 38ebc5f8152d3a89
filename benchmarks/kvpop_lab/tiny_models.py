"""Tiny random-init models of real architectures (no download) for benchmarks and tests: a few layers of Qwen3,
Llama, Qwen2 or Mistral with ``VOCAB`` tokens, and token ids without repeats."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 256


def tiny_config(arch: str = "qwen3", layers: int = 2, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    common.update(overrides)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "qwen3", attn: str = "kvpop", seed: int = 0, layers: int = 2, **overrides):
    """A random-init model; norm weights are randomised so keys have distinct norms: with unit
    norm weights every Qwen3 key has the same norm and float noise would decide priority ties."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers, **overrides), attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
    return model.eval()


def distinct_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids without repeats inside a row (repeats tie priorities exactly)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(VOCAB, generator=g)[:length] for _ in range(batch)])
