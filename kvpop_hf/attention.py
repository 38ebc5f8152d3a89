"""The ``"kvpop"`` attention implementation: exact per-head fixed-budget masks inside prompt chunks.

Registered on import with `transformers.AttentionInterface` and `AttentionMaskInterface`
(both are needed: without a mask function of the same name every call gets no mask).
Select it with ``attn_implementation="kvpop"`` or ``model.set_attn_implementation("kvpop")``.

Flow per forward: the mask function records the forward's 2D padding mask; the KVpopCache layer's
``update`` (which runs right before the layer's attention) consumes it, stores the new tokens and
leaves a pending record here keyed by ``layer_idx``; the attention function picks it up and
attends each query to exactly its set ``R(q)`` per KV head. Without a KVpopCache (training, other
caches) the function is plain causal attention with padding.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

ATTN_NAME = "kvpop"

_PENDING: dict[int, tuple[object, torch.Tensor]] = {}
_PADDING: list[torch.Tensor | None] = [None]


@dataclass
class KVpopMaskInfo:
    """What the ``kvpop`` mask function hands to the attention function: the padding of this
    forward's queries ``[b, q]`` (True = real token) and the arguments to build a dense causal
    mask for the fallback path (no KVpopCache)."""

    valid: torch.Tensor | None
    dense_kwargs: dict

    def dense(self) -> torch.Tensor | None:
        return sdpa_mask(**self.dense_kwargs)


def kvpop_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None, **kwargs):
    valid = None
    if attention_mask is not None and attention_mask.ndim == 2:
        valid = attention_mask[:, -q_length:].bool()
    _PADDING[0] = valid
    dense_kwargs = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, device=kwargs.get("device", "cpu"))
    if "cache_position" in kwargs:  # transformers versions that still pass cache positions
        dense_kwargs["cache_position"] = kwargs["cache_position"]
    else:
        dense_kwargs["q_offset"] = q_offset
    return KVpopMaskInfo(valid, dense_kwargs)


def pop_padding(batch: int, q_len: int) -> torch.Tensor | None:
    """The padding mask recorded for this forward, if it fits ``[batch, q_len]``; clears it."""
    valid, _PADDING[0] = _PADDING[0], None
    if valid is None or tuple(valid.shape) != (batch, q_len):
        return None
    return valid


def register_pending(layer, keys: torch.Tensor) -> None:
    _PENDING[layer.layer_idx] = (layer, keys)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# -- multi-token chunks through FlexAttention (GPU): no dense [L x C] mask ---------------------------
_CHUNK_MODES = ("auto", "flex", "dense")
_CHUNK_MODE: list[str] = [os.environ.get("KVPOP_CHUNK_ATTENTION", "auto").lower()]
_FLEX_FNS: dict[str, tuple[Callable, Callable, bool]] = {}


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
    """``(flex_attention, create_block_mask, supports_gqa)``; compiled once per process on CUDA."""
    fns = _FLEX_FNS.get(device_type)
    if fns is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        gqa = "enable_gqa" in inspect.signature(flex_attention).parameters
        if device_type == "cuda":
            # compiled: the kernel never builds scores or masks densely (create_block_mask is only used
            # with KVPOP_FLEX_BLOCK_MASK=create; see flex_mask.build_block_mask)
            dynamic = os.environ.get("KVPOP_FLEX_DYNAMIC")
            dynamic = None if dynamic is None else dynamic.lower() in ("1", "true")
            fns = (torch.compile(flex_attention, dynamic=dynamic), torch.compile(create_block_mask, dynamic=dynamic),
                   gqa)
        else:
            fns = (flex_attention, create_block_mask, gqa)
        _FLEX_FNS[device_type] = fns
    return fns


def _flex_chunk_attention(plan, query, key, value, scaling):
    from .flex_mask import build_block_mask

    b, hq, L, _ = query.shape
    hkv, C = key.shape[1], key.shape[2]
    groups = hq // hkv
    flex, make_block_mask, gqa = _flex_fns(query.device.type)
    cm = plan.compact()
    if os.environ.get("KVPOP_FLEX_BLOCK_MASK", "tiled") == "create":
        block_mask = make_block_mask(cm.mask_mod(groups), b, hq, L, C, device=query.device)
    else:  # default: never holds the [b, Hq, L, C] grid (create_block_mask does, even compiled)
        block_mask = build_block_mask(cm, groups)
    key, value = key.to(query.dtype), value.to(query.dtype)
    if groups > 1 and not gqa:
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    kw = {"enable_gqa": True} if groups > 1 and gqa else {}
    out = flex(query, key, value, block_mask=block_mask, scale=scaling, **kw)
    return out.transpose(1, 2).contiguous()


def kvpop_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]`` -> (out ``[b, L, Hq, d]``, None)."""
    layer_idx = getattr(module, "layer_idx", None)
    pending = _PENDING.pop(layer_idx, None)
    b, hq, L, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    if pending is None or pending[1] is not key:
        # no KVpopCache in this forward: plain causal attention with padding
        if layer_idx == 0:
            _PADDING[0] = None
        mask = attention_mask.dense() if isinstance(attention_mask, KVpopMaskInfo) else attention_mask
        out = F.scaled_dot_product_attention(
            query, _repeat_kv(key, groups), _repeat_kv(value, groups), attn_mask=mask, scale=scaling,
            dropout_p=dropout if module.training else 0.0, is_causal=mask is None and L > 1)
        return out.transpose(1, 2).contiguous(), None
    layer = pending[0]
    plan = layer.plan
    if plan is None:
        # single-token decode: the returned entries are exactly R(q); mask empty slots of padded rows
        mask = None
        if layer.cache.has_padding:
            n = key.shape[2]
            mask = (layer.pos[:, :, :n] >= 0)[:, :, None, :]
            mask = _repeat_kv(mask, groups)
        out = F.scaled_dot_product_attention(query, _repeat_kv(key, groups), _repeat_kv(value, groups),
                                             attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    layer.plan = None
    if use_flex(query):
        return _flex_chunk_attention(plan, query, key, value, scaling), None
    vis = plan.visibility()  # [b, hkv, L, C]
    # group the G query heads of each KV head along the query axis: no copy of keys/values
    q = query.reshape(b, hkv, groups * L, d)
    mask = vis[:, :, None].expand(b, hkv, groups, L, vis.shape[-1]).reshape(b, hkv, groups * L, vis.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(b, hq, L, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the ``"kvpop"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvpop_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvpop_mask)
