"""Attention variants of the models people run now, as their own eager attention computes them.

* attention logit softcapping (Gemma2): ``logits = softcap * tanh(scaling * q.k / softcap)``, before the mask;
* learned per-head sinks (GPT-OSS, the ``s_aux`` keyword): one extra logit per query head that takes part in
  the softmax and attends to nothing (a zero value), so ``out = softmax([logits, s_h])[:-1] @ v``;
* sliding-window masks (Gemma, GPT-OSS, Mistral, Qwen2, OLMo3): a key ``t`` is visible to the query ``q`` iff
  ``q - W < t <= q``; transformers builds them into the mask it hands the attention, a KVpop layer on a sliding
  layer adds them to its per-head set (:mod:`kvpop_hf.sliding_layer`);
* ``scaling`` (e.g. Gemma's ``query_pre_attn_scalar ** -0.5``) is whatever the model passes.

:func:`variant_attention` is the plain torch reference every path with a softcap or sinks uses: the fused paths
(SDPA, FlexAttention, the Triton decode kernel) compute a plain softmax, so a call with a variant is routed here
rather than to them (docs/hybrid_models.md). Masked logits get the dtype's minimum, as transformers' eager
attention adds it, so a fully masked row is uniform instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .ops.dense_attention import expand_kv

__all__ = ["AttentionVariant", "variant_attention", "causal_visible"]


@dataclass(frozen=True)
class AttentionVariant:
    """softcap: the logit cap (None or 0: none); sinks: ``[Hq]`` learned sink logits or None."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def of(cls, kwargs: dict, module=None) -> "AttentionVariant":
        """From the keyword arguments transformers' attention modules pass to an attention function
        (``softcap=`` in Gemma2, ``s_aux=`` in GPT-OSS), else the module's learned ``sinks`` parameter (the
        attribute GPT-OSS's eager attention reads)."""
        sinks = kwargs.get("s_aux")
        if sinks is None and isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            sinks = module.sinks
        return cls(kwargs.get("softcap") or None, sinks)

    @property
    def plain(self) -> bool:
        """True when this is a plain softmax (the fused paths compute exactly that)."""
        return not self.softcap and self.sinks is None

    def describe(self) -> str:
        parts = ([f"softcap={self.softcap}"] if self.softcap else []) + (["learned sinks"] if self.sinks is not None
                                                                        else [])
        return ", ".join(parts) or "plain softmax"


PLAIN = AttentionVariant()


def variant_logits(query: torch.Tensor, key: torch.Tensor, scaling: float | None,
                   variant: AttentionVariant = PLAIN) -> torch.Tensor:
    """float32 logits ``[b, Hq, L, C]`` (softcapped where the variant says so); query ``[b, Hq, L, d]``,
    key ``[b, Hkv, C, d]``."""
    groups = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = (query.float() @ expand_kv(key, groups).float().transpose(-1, -2)) * scale
    if variant.softcap:
        logits = torch.tanh(logits / variant.softcap) * variant.softcap
    return logits


def _mask_logits(logits: torch.Tensor, mask: torch.Tensor | None, groups: int) -> torch.Tensor:
    if mask is None:
        return logits
    if mask.dim() == 4 and mask.shape[1] not in (1, logits.shape[1]):
        mask = expand_kv(mask, groups)  # one mask per KV head -> per query head
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    return logits + mask.float()


def variant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float | None, variant: AttentionVariant = PLAIN, dropout: float = 0.0,
                      return_lse: bool = False):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]``, mask broadcastable to ``[b, Hq, L, C]`` (bool:
    True = visible, or additive float; a head dimension of ``Hkv`` is shared by the query heads of a KV head) or
    None (all visible) -> out ``[b, L, Hq, dv]`` in the query's dtype (and, with ``return_lse``, the float32
    log-sum-exp ``[b, Hq, L]`` of the softmax's denominator, the sink included)."""
    b, hq, L, _ = query.shape
    groups = hq // key.shape[1]
    logits = _mask_logits(variant_logits(query, key, scaling, variant), mask, groups)
    if variant.sinks is not None:
        sink = variant.sinks.float().to(logits.device).reshape(1, hq, 1, 1).expand(b, hq, L, 1)
        logits = torch.cat([logits, sink], dim=-1)
    lse = logits.logsumexp(-1)
    probs = (logits - lse[..., None]).exp()
    if variant.sinks is not None:
        probs = probs[..., :-1]
    if dropout:
        probs = F.dropout(probs, p=dropout, training=True)
    out = (probs @ expand_kv(value, groups).float()).to(query.dtype).transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def causal_visible(q_length: int, kv_length: int, sliding_window: int | None, device) -> torch.Tensor:
    """``[1, 1, L, C]`` bool: the ``L`` queries are the last ``L`` of ``C`` consecutive positions; key ``t`` is
    visible to query ``q`` iff ``t <= q`` (and ``q - t < sliding_window`` when one is given)."""
    q = torch.arange(kv_length - q_length, kv_length, device=device)[:, None]
    t = torch.arange(kv_length, device=device)[None, :]
    vis = t <= q
    if sliding_window is not None:
        vis &= q - t < sliding_window
    return vis[None, None]
