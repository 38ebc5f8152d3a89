"""A KVpopCache prompt chunk's attention: each query attends to its exact per-head set ``R(q)``.

The chunk's :class:`~kvpop_hf.layer.ChunkPlan` gives, per (row, KV head), the candidates (stored slots, then
the chunk's new tokens) and which of them each query sees. Two implementations:

* dense: the plan's ``[b, Hkv, L, C]`` visibility as an SDPA mask (the G query heads of a KV head share it);
* flex: FlexAttention with a block mask built from the plan's compact form (no ``[L x C]`` mask), compiled on
  CUDA (:mod:`kvpop_hf.flex_compiled`).
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F

_CHUNK_MODES = ("auto", "flex", "dense")
_CHUNK_MODE: list[str] = [os.environ.get("KVPOP_CHUNK_ATTENTION", "auto").lower()]


def set_chunk_attention(mode: str) -> str:
    """How multi-token chunks are attended: ``"auto"`` (FlexAttention on CUDA, dense SDPA mask otherwise),
    ``"flex"`` (always FlexAttention; eager on CPU, for testing) or ``"dense"``. Returns the previous mode.
    The default comes from the env var ``KVPOP_CHUNK_ATTENTION``."""
    mode = mode.lower()
    if mode not in _CHUNK_MODES:
        raise ValueError(f"chunk attention mode must be one of {_CHUNK_MODES}, got {mode!r}")
    old, _CHUNK_MODE[0] = _CHUNK_MODE[0], mode
    return old


def use_flex(query: torch.Tensor) -> bool:
    mode = _CHUNK_MODE[0]
    if mode not in _CHUNK_MODES:
        raise ValueError(f"KVPOP_CHUNK_ATTENTION must be one of {_CHUNK_MODES}, got {mode!r}")
    return mode == "flex" or (mode == "auto" and query.is_cuda)


def _flex_fns(device_type: str):
    """``(flex_attention, create_block_mask)``, compiled on CUDA with the inference policy (flex_compiled.py)."""
    from .flex_compiled import compiled_create_block_mask, compiled_flex, inference_dynamic

    dynamic = inference_dynamic()
    return compiled_flex(device_type, dynamic), compiled_create_block_mask(device_type, dynamic)


def flex_chunk_attention(plan, query, key, value, scaling):
    """FlexAttention over the chunk's candidates. By default (``KVPOP_FLEX_BLOCK_MASK=interval``) the candidates
    are reordered so that each query block visits about ``B / 128`` key blocks (kvpop_hf/interval_mask.py);
    ``tiled`` keeps plan order with the rank/cutoff block flags, ``create`` uses ``create_block_mask``."""
    b, hq, L, _ = query.shape
    hkv, C = key.shape[1], key.shape[2]
    groups = hq // hkv
    flex, make_block_mask = _flex_fns(query.device.type)
    cm = plan.compact()
    layout = os.environ.get("KVPOP_FLEX_BLOCK_MASK", "interval")
    if layout not in ("interval", "tiled", "create"):
        raise ValueError(f"KVPOP_FLEX_BLOCK_MASK must be interval, tiled or create, got {layout!r}")
    if layout == "interval":
        from .interval_mask import interval_block_mask, interval_chunk_mask, interval_layout

        im = interval_layout(interval_chunk_mask(cm))
        key = key.gather(2, im.perm[..., None].expand(b, hkv, C, key.shape[-1]))
        value = value.gather(2, im.perm[..., None].expand(b, hkv, C, value.shape[-1]))
        block_mask = interval_block_mask(im, groups)
    elif layout == "create":
        block_mask = make_block_mask(cm.mask_mod(groups), b, hq, L, C, device=query.device)
    else:  # never holds the [b, Hq, L, C] grid (create_block_mask does, even compiled)
        from .flex_mask import build_block_mask

        block_mask = build_block_mask(cm, groups)
    key, value = key.to(query.dtype), value.to(query.dtype)
    kw = {"enable_gqa": True} if groups > 1 else {}
    out = flex(query, key, value, block_mask=block_mask, scale=scaling, **kw)
    return out.transpose(1, 2).contiguous()


def attend_chunk(plan, query, key, value, scaling):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]`` (the plan's candidates) -> ``[b, L, Hq, dv]``."""
    if use_flex(query):
        return flex_chunk_attention(plan, query, key, value, scaling)
    b, hq, L, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    vis = plan.visibility()  # [b, hkv, L, C]
    # group the G query heads of each KV head along the query axis: no copy of keys/values
    q = query.reshape(b, hkv, groups * L, d)
    mask = vis[:, :, None].expand(b, hkv, groups, L, vis.shape[-1]).reshape(b, hkv, groups * L, vis.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, L, value.shape[-1]).transpose(1, 2).contiguous()
