"""Fixed-budget sparse attention over whole sequences (training), from running top-k ranks.

Mask (DESIGN.md §2): ``M[q, t] = t <= q and (t < s or q - t < w or (t in E(q) and rank[t] <= cutoff[q]))``
with ``E(q) = {s <= t <= q - w}``. The FlexAttention path builds it from ``rank [b,h,S]`` and
``cutoff [b,h,S]`` inside a ``mask_mod`` (no ``S x S`` tensor); the reference materialises it.
Both return the output ``[b, Hq, S, d]`` and the log-sum-exp ``[b, Hq, S]`` of each query.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.attention.flex_attention as _fa
from torch.nn.attention.flex_attention import flex_attention

from ..flex_mask import tiled_block_mask
from ..topk import RunningTopK, sparse_mask_reference


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex(device):
    return _compiled_flex() if device.type == "cuda" else flex_attention


def sparse_attention(query, key, value, topk: RunningTopK, sinks: int, window: int, scale: float | None = None):
    """query ``[b, Hq, S, d]``, key/value ``[b, Hkv, S, d]`` -> (out ``[b, Hq, S, d]``, lse ``[b, Hq, S]``)."""
    b, hq, S, _ = query.shape
    groups = hq // key.shape[1]
    # FlexAttention needs one dtype; under autocast q/k (normed in float32) and v can differ
    key, value = key.to(query.dtype), value.to(query.dtype)
    rank, cutoff = topk.rank, topk.cutoff

    def kv_mask_mod(bi, hk, q_idx, kv_idx):  # indexed by KV head
        recent = (kv_idx <= q_idx) & ((kv_idx < sinks) | (q_idx - kv_idx < window))
        kept = (kv_idx >= sinks) & (kv_idx <= q_idx - window) & (rank[bi, hk, kv_idx] <= cutoff[bi, hk, q_idx])
        return recent | kept

    def mask_mod(bi, h, q_idx, kv_idx):
        return kv_mask_mod(bi, h // groups, q_idx, kv_idx)

    # built tile by tile: create_block_mask would evaluate the whole [b, Hq, S, S] grid
    block_mask = tiled_block_mask(kv_mask_mod, b, key.shape[1], S, S, groups, mask_mod, query.device)
    kw = dict(block_mask=block_mask, scale=scale)
    if groups > 1:
        kw["enable_gqa"] = True
    if hasattr(_fa, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        out, aux = _flex(query.device)(query, key, value, return_aux=_fa.AuxRequest(lse=True), **kw)
        return out, aux.lse.float()
    out, lse = _flex(query.device)(query, key, value, return_lse=True, **kw)
    return out, lse.float()


def sparse_attention_reference(query, key, value, topk: RunningTopK, sinks: int, window: int, scale=None):
    """Materialised-mask reference of :func:`sparse_attention` (small sizes only)."""
    groups = query.shape[1] // key.shape[1]
    mask = sparse_mask_reference(topk, sinks, window).repeat_interleave(groups, dim=1)
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ v.float()
    return out.to(query.dtype), lse
