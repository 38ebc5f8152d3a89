"""The query, key and value tensors a model's attention sees, recorded from one dense forward (for the oracle, the
retention analyses and the needed-line benchmark)."""

from __future__ import annotations

import torch

from kvpop_hf.ops.dense_attention import causal_attention

_REC_NAME = "kvpop_record"


@torch.no_grad()
def record_qkv(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Dense causal forward of ``ids [1, S]``; returns ``{layer: (q, k, v, scaling)}`` with post-RoPE
    q ``[1, Hq, S, D]``, k/v ``[1, Hkv, S, D]`` (float32, on the model's device)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    store: dict[int, tuple] = {}

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        store[module.layer_idx] = (query.float(), key.float(), value.float(), float(scaling))
        return causal_attention(query, key, value, None, scaling), None

    AttentionInterface.register(_REC_NAME, attn)
    AttentionMaskInterface.register(_REC_NAME, lambda *a, **k: None)
    old = model.config._attn_implementation
    model.set_attn_implementation(_REC_NAME)
    try:
        model(ids, use_cache=False)
    finally:
        model.set_attn_implementation(old)
    return store
