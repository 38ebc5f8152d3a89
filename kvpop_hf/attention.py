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
    vis = plan.visibility()  # [b, hkv, L, C]
    layer.plan = None
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
