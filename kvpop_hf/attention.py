"""The ``"kvpop"`` attention implementation: exact per-head fixed-budget masks inside prompt chunks.

Registered on import with `transformers.AttentionInterface` and `AttentionMaskInterface`
(both are needed: without a mask function of the same name every call gets no mask).
Select it with ``attn_implementation="kvpop"`` or ``model.set_attn_implementation("kvpop")``.

Hand-off, per call and without module state: the mask function returns a :class:`KVpopMaskInfo`
(the padding of this forward's queries); a cache layer's ``update`` (which runs right before the layer's
attention) returns keys that carry what the attention needs (:mod:`kvpop_hf.handoff`):

* a :class:`~kvpop_hf.handoff.Handoff` (a KVpopCache prompt chunk, a step of an attention-based policy,
  a DMS step), whose ``attend`` runs the call with the padding;
* else, for a KVpopCache decode step, :class:`~kvpop_hf.handoff.DecodeSlots`: all ``B`` slots of the
  layer's fixed buffers and the real tokens per row, which mask the empty slots. Fixed shapes, so the step
  can be captured as a CUDA graph (:mod:`kvpop_hf.ops.decode_attention`).

Keys with neither come from another cache (or none: training); they get plain causal attention with padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from .attention_variants import AttentionVariant, causal_visible, variant_attention
from .ops.dense_attention import causal_attention
from .handoff import decode_slots_of, handoff_of

ATTN_NAME = "kvpop"


@dataclass
class KVpopMaskInfo:
    """What the ``kvpop`` mask function hands to the attention function: the padding of this
    forward's queries ``[b, q]`` (True = real token) and the arguments to build a dense causal
    mask for the fallback path (no KVpopCache).

    ``generate`` builds the mask ahead of the forward when the cache is compileable and passes it
    in as ``attention_mask``; the model then calls the mask function again with it. ``ndim = 4``
    makes transformers treat it as a prepared mask (not a 2D padding mask) and :func:`kvpop_mask`
    returns it unchanged.

    For one query per row (a decode step) the dense mask is built right away (``prepared``): the attention of a
    layer whose keys come from another cache (a sliding-window layer) reads that tensor, so a compiled decode step
    neither builds the mask from the Python ints of ``dense_kwargs`` (offsets that change every step, which dynamo
    would guard on) nor reads the 2D padding mask that grows every step. Built by ``generate`` ahead of a compiled
    forward, it enters the graph as a tensor of fixed shape."""

    valid: torch.Tensor | None
    dense_kwargs: dict
    prepared: torch.Tensor | None = None
    ndim = 4

    def dense(self) -> torch.Tensor | None:
        if self.prepared is not None:
            return self.prepared
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
    info = KVpopMaskInfo(valid, dense_kwargs)
    if q_length == 1:
        info.prepared = info.dense()
    return info


def kvpop_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]`` -> (out ``[b, L, Hq, d]``, None).

    A decode step (one query) over a static-priority KVpop layer's slots or over another cache's keys (the sliding
    layers of a hybrid model) is traced by ``torch.compile``; prompt chunks and the hand-offs of attention-based
    policies and DMS run eagerly, as the cache's chunk updates do (see ``KVpopLayer.update``).

    The model's attention variant comes in ``kwargs`` (``softcap=`` Gemma2, ``s_aux=`` GPT-OSS sinks): every path
    applies it (:mod:`kvpop_hf.attention_variants`); the fused kernels compute a plain softmax, so a call with a
    variant takes the torch reference. Sliding windows come in the mask transformers builds (layers that keep their
    sliding-window cache) or from the layer itself (:mod:`kvpop_hf.sliding_layer`)."""
    variant = AttentionVariant.of(kwargs, module)
    if query.shape[2] == 1 and handoff_of(key) is None:
        slots = decode_slots_of(key)
        if slots is not None:
            return slots.attend(query, key, value, scaling, variant), None
        # a decode query over another cache's keys (a sliding-window layer): traced, so that a compiled decode step
        # of a hybrid model stays one graph
        return attend_other_keys(module, query, key, value, attention_mask, scaling, dropout, variant,
                                 kwargs.get("sliding_window")), None
    return _attention_eagerly(module, query, key, value, attention_mask, scaling, dropout, variant,
                              kwargs.get("sliding_window")), None


@torch.compiler.disable
def _attention_eagerly(module, query, key, value, attention_mask, scaling, dropout, variant=None,
                       sliding_window=None):
    variant = variant or AttentionVariant()
    handoff = handoff_of(key)
    if handoff is not None:  # a KVpopCache chunk, an attention-based policy, DMS (kvpop_hf/handoff.py)
        valid = attention_mask.valid if isinstance(attention_mask, KVpopMaskInfo) else None
        if variant.plain:
            return handoff.attend(query, key, value, valid, scaling)
        if handoff.kind != "chunk":
            raise ValueError(f"The {handoff.kind!r} attention of this cache computes a plain softmax, but the model's "
                             f"attention has {variant.describe()}: use KVpopCache with a static-priority scorer "
                             "(e.g. 'knorm' or a trained one) for this model.")
        return handoff.attend(query, key, value, valid, scaling, variant=variant)
    return attend_other_keys(module, query, key, value, attention_mask, scaling, dropout, variant, sliding_window)


def attend_other_keys(module, query, key, value, attention_mask, scaling, dropout, variant=None,
                      sliding_window=None):
    """Keys from another cache (e.g. a sliding-window layer) or none: causal attention with padding and the model's
    mask (sliding window included), the variant (softcap, sinks) in the torch reference. Torch ops only: a decode
    step calls it directly (``torch.compile`` traces it into the step's graph), a prompt chunk through
    :func:`_attention_eagerly`."""
    variant = variant or AttentionVariant()
    mask = attention_mask.dense() if isinstance(attention_mask, KVpopMaskInfo) else attention_mask
    dropout = dropout if module.training else 0.0
    if variant.plain:
        if mask is None and sliding_window is not None and query.shape[2] > 1:
            mask = causal_visible(query.shape[2], key.shape[2], sliding_window, query.device)
        return causal_attention(query, key, value, mask, scaling, dropout)
    if mask is None:
        mask = causal_visible(query.shape[2], key.shape[2], sliding_window, query.device)
    return variant_attention(query, key, value, mask, scaling, variant, dropout)


def register() -> None:
    """Register the ``"kvpop"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvpop_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvpop_mask)
