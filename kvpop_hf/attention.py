"""The ``"kvpop"`` attention implementation: exact per-head fixed-budget masks inside prompt chunks.

Registered on import with `transformers.AttentionInterface` and `AttentionMaskInterface`
(both are needed: without a mask function of the same name every call gets no mask).
Select it with ``attn_implementation="kvpop"`` or ``model.set_attn_implementation("kvpop")``.

Hand-off, per call and without module state: the mask function returns a :class:`KVpopMaskInfo`
(the padding of this forward's queries); a KVpopCache layer's ``update`` (which runs right before
the layer's attention) returns tensors that carry what the attention needs:

* a prompt chunk: the candidates, with ``key.kvpop_chunk`` (a :class:`~kvpop_hf.layer.PendingChunk`)
  that the attention commits with the padding, getting the exact per-head plan ``R(q)``;
* a decode step: all ``B`` slots of the layer's fixed buffers, with ``key.kvpop_seen`` (real tokens
  per row) that masks the empty slots. Fixed shapes, so the step can be captured as a CUDA graph;
  the attention itself is split along the slots on CUDA (:mod:`kvpop_hf.decode_attention`).

Keys without these attributes come from another cache (or none: training); they get plain causal
attention with padding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from .baselines.attention_policies.scores import attend_and_score
from .decode_attention import decode_attention
from .dense_attention import causal_attention

ATTN_NAME = "kvpop"


@dataclass
class KVpopMaskInfo:
    """What the ``kvpop`` mask function hands to the attention function: the padding of this
    forward's queries ``[b, q]`` (True = real token) and the arguments to build a dense causal
    mask for the fallback path (no KVpopCache).

    ``generate`` builds the mask ahead of the forward when the cache is compileable and passes it
    in as ``attention_mask``; the model then calls the mask function again with it. ``ndim = 4``
    makes transformers treat it as a prepared mask (not a 2D padding mask) and :func:`kvpop_mask`
    returns it unchanged."""

    valid: torch.Tensor | None
    dense_kwargs: dict
    ndim = 4

    def dense(self) -> torch.Tensor | None:
        return sdpa_mask(**self.dense_kwargs)


def kvpop_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None, **kwargs):
    if isinstance(attention_mask, KVpopMaskInfo):  # prepared by generate for this very forward
        return attention_mask
    valid = None
    if attention_mask is not None and attention_mask.ndim == 2:
        valid = attention_mask[:, -q_length:].bool()
    dense_kwargs = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, device=kwargs.get("device", "cpu"))
    if "cache_position" in kwargs:  # transformers versions that still pass cache positions
        dense_kwargs["cache_position"] = kwargs["cache_position"]
    else:
        dense_kwargs["q_offset"] = q_offset
    return KVpopMaskInfo(valid, dense_kwargs)


# -- multi-token chunks through FlexAttention (GPU): no dense [L x C] mask ---------------------------
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


def _flex_chunk_attention(plan, query, key, value, scaling):
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


def _chunk_attention(chunk, query, key, value, attention_mask, scaling):
    """A prompt chunk: commit it with this forward's padding, then attend each query to ``R(q)`` per head."""
    valid = attention_mask.valid if isinstance(attention_mask, KVpopMaskInfo) else None
    plan = chunk.commit(valid, key, value)
    if use_flex(query):
        return _flex_chunk_attention(plan, query, key, value, scaling)
    b, hq, L, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    vis = plan.visibility()  # [b, hkv, L, C]
    # group the G query heads of each KV head along the query axis: no copy of keys/values
    q = query.reshape(b, hkv, groups * L, d)
    mask = vis[:, :, None].expand(b, hkv, groups, L, vis.shape[-1]).reshape(b, hkv, groups * L, vis.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, L, value.shape[-1]).transpose(1, 2).contiguous()


def kvpop_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]`` -> (out ``[b, L, Hq, d]``, None).

    A static-priority decode step is traced by ``torch.compile`` (fixed shapes); every other call runs
    eagerly, as the cache's chunk updates do (see ``KVpopLayer.update``)."""
    if query.shape[2] == 1 and getattr(key, "kvpop_scores", None) is None:
        seen = getattr(key, "kvpop_seen", None)
        if seen is not None:
            return decode_attention(query, key, value, seen, scaling), None
    return _attention_eagerly(module, query, key, value, attention_mask, scaling, dropout), None


@torch.compiler.disable
def _attention_eagerly(module, query, key, value, attention_mask, scaling, dropout):
    scores = getattr(key, "kvpop_scores", None)
    if scores is not None:  # attention-based policies (TOVA, H2O, SnapKV): kvpop_hf/baselines/attention_policies/scores.py
        valid = attention_mask.valid if isinstance(attention_mask, KVpopMaskInfo) else None
        return attend_and_score(scores, query, key, value, valid, scaling)
    dms = getattr(key, "kvpop_dms", None)
    if dms is not None:  # DMS: a different set of tokens per KV head (kvpop_hf/baselines/dms/handoff.py)
        valid = attention_mask.valid if isinstance(attention_mask, KVpopMaskInfo) else None
        return dms.attend(query, key, value, valid, scaling)
    chunk = getattr(key, "kvpop_chunk", None)
    if chunk is not None:
        return _chunk_attention(chunk, query, key, value, attention_mask, scaling)
    # keys from another cache or none: plain causal attention with padding
    mask = attention_mask.dense() if isinstance(attention_mask, KVpopMaskInfo) else attention_mask
    return causal_attention(query, key, value, mask, scaling, dropout if module.training else 0.0)


def register() -> None:
    """Register the ``"kvpop"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvpop_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvpop_mask)
