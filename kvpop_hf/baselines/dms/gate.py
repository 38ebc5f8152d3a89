"""The DMS eviction gate: one decision logit per token, layer and KV head, read from the hidden state.

DMS (Dynamic Memory Sparsification; Łańcucki et al., 2025, the learned baseline of KVpop, arXiv:2607.05061)
predicts for every new token and KV head whether it will be evicted, ``alpha_t = sigmoid(logit_t)``,
and takes the logit from the hidden state by repurposing one output dimension of the query/key projection.

Here the logit is a separate linear read-out of the head's value vector,

    logit[l, h, t] = w[l, h] . v[l, h, t] + b[l, h],      v[l, h, t] = W_v[l, h] x[l, t]

so it is a linear function of the layer's hidden state ``x`` (through the head's value projection, the only
projection the cache sees before RoPE or normalisation mixes in the position). Why not the paper's neuron:

* the base model is left untouched: with ``w = 0`` and a negative ``b`` the gated model *is* the teacher
  (no attention dimension is given up, nothing to re-learn);
* it is as small: ``head_dim + 1`` parameters per (layer, KV head), where the repurposed neuron is a row of
  ``hidden_size`` weights; a LoRA on ``v_proj`` can still shape what the gate reads;
* the value states reach both the training attention and ``Cache.update`` of every transformers model, so no
  forward hooks are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import check_int


class DMSGate(nn.Module):
    """Per-layer, per-KV-head eviction logits. weight ``[layers, kv_heads, head_dim]`` (zero at start),
    bias ``[layers, kv_heads]`` (``init_bias``: ``sigmoid(init_bias)`` is the starting eviction probability)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, init_bias: float = -2.0):
        super().__init__()
        self.num_layers = check_int("num_layers", num_layers, 1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        self.head_dim = check_int("head_dim", head_dim, 1)
        self.weight = nn.Parameter(torch.zeros(num_layers, num_kv_heads, head_dim))
        self.bias = nn.Parameter(torch.full((num_layers, num_kv_heads), float(init_bias)))

    def forward(self, layer_idx: int, values: torch.Tensor) -> torch.Tensor:
        """values ``[b, kv_heads, T, head_dim]`` -> logits ``[b, kv_heads, T]`` float32 (evict iff > 0)."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"DMSGate has {self.num_layers} layers, got layer_idx={layer_idx}.")
        if values.dim() != 4 or tuple(values.shape[1::2]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"DMSGate expects values [batch, {self.num_kv_heads}, tokens, {self.head_dim}], "
                             f"got {tuple(values.shape)}: the gate belongs to another model.")
        w = self.weight[layer_idx].to(values.device, torch.float32)
        b = self.bias[layer_idx].to(values.device, torch.float32)
        return torch.einsum("bhtd,hd->bht", values.float(), w) + b[None, :, None]
