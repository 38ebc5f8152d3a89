"""Fixed-budget sparse attention over whole sequences (training), from running top-k ranks.

Mask (docs/design.md §6, the running top-k): ``M[q, t] = t <= q and (t < s or q - t < w or (t in E(q) and rank[t] <= cutoff[q]))``
with ``E(q) = {s <= t <= q - w}``. The FlexAttention path builds it from ``rank [b,h,S]`` and
``cutoff [b,h,S]`` inside a ``mask_mod`` (no ``S x S`` tensor); the reference materialises it.
Both return the output ``[b, Hq, S, d]`` and the log-sum-exp ``[b, Hq, S]`` of each query.
"""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as _fa

from .block_masks import sparse_block_mask
from .dense_attention import expand_kv
from .flex_compiled import training_flex
from .flex_mask import tiled_block_mask
from .interval_layout import IntervalLayout, interval_sparse_layout
from .running_topk import RunningTopK, sparse_mask_reference


def sparse_mask_mods(topk: RunningTopK, sinks: int, window: int, groups: int):
    """(``kv_mask_mod`` indexed by KV head, ``mask_mod`` indexed by query head) of the running top-k mask.

    ``t <= q and (t < s or q - t < w or (s <= t <= q - w and rank[t] <= cutoff[q]))`` is evaluated as
    ``t <= q and (q - t < w or rank'[t] <= cutoff[q])`` with ``rank' = rank`` for ``t >= s`` and the int32
    minimum for sinks (``cutoff >= -1``), so sinks always pass and every non-window key ``t >= s`` with
    ``t <= q`` is in ``E(q)``: the same boolean mask with fewer ops, int32 loads inside the kernel."""
    S = topk.rank.shape[-1]
    rank = topk.rank
    if S >= 2**31 - 1:  # pragma: no cover - int32 indices would overflow
        raise ValueError(f"sequence too long for int32 ranks: {S}")
    t = torch.arange(S, device=rank.device)
    rank = torch.where(t < sinks, torch.iinfo(torch.int32).min, rank).to(torch.int32).contiguous()
    cutoff = topk.cutoff.to(torch.int32).contiguous()

    def kv_mask_mod(bi, hk, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < window) | (rank[bi, hk, kv_idx] <= cutoff[bi, hk, q_idx]))

    def mask_mod(bi, h, q_idx, kv_idx):
        return kv_mask_mod(bi, h // groups, q_idx, kv_idx)

    return kv_mask_mod, mask_mod


def sparse_attention_block_mask(topk: RunningTopK, sinks: int, window: int, groups: int, method: str = "interval"):
    """The mask of :func:`sparse_attention` for ``Hq = Hkv * groups`` query heads.

    ``method="interval"`` (default): an :class:`~kvpop_hf.ops.interval_layout.IntervalLayout` (the keys
    reordered so that a query block visits about ``B / 128`` mostly full key blocks, ``O(S log S)`` work per
    head). The others give a ``BlockMask`` over the keys in position order (every block below the diagonal
    visited): ``"analytic"``: per-block flags from rank/cutoff (:func:`kvpop_hf.ops.block_masks.sparse_block_mask`,
    ``O(S^2 / 128)`` work, a few dozen kernels); ``"tiled"``: the mask_mod evaluated tile by tile
    (:func:`kvpop_hf.ops.flex_mask.tiled_block_mask`, ``O(S^2)`` work, one loop step per query block). Both give the
    same blocks as ``create_block_mask``."""
    if method == "interval":
        return interval_sparse_layout(topk, sinks, window, groups)
    kv_mask_mod, mask_mod = sparse_mask_mods(topk, sinks, window, groups)
    b, hkv, S = topk.rank.shape
    if method == "analytic":
        return sparse_block_mask(topk.rank, topk.cutoff, sinks, window, groups, mask_mod)
    if method == "tiled":
        return tiled_block_mask(kv_mask_mod, b, hkv, S, S, groups, mask_mod, topk.rank.device)
    raise ValueError(f"method must be 'interval', 'analytic' or 'tiled', got {method!r}")


def sparse_attention(query, key, value, topk: RunningTopK, sinks: int, window: int, scale: float | None = None,
                     block_mask=None, kernel_options: dict | None = None, softcap: float | None = None):
    """query ``[b, Hq, S, d]``, key/value ``[b, Hkv, S, d]`` -> (out ``[b, Hq, S, d]``, lse ``[b, Hq, S]``).

    ``block_mask``: a prebuilt :func:`sparse_attention_block_mask` of the same ``topk`` (an ``IntervalLayout``,
    whose order the keys and values are gathered into first, or a ``BlockMask`` over position order); built
    here (interval layout) if None. ``kernel_options``: passed to FlexAttention (e.g. ``BLOCK_M``/``BLOCK_N``).
    ``softcap``: the model's attention logit cap (Gemma2), a ``score_mod``; learned sinks: :func:`apply_sinks`."""
    b, hq, S, _ = query.shape
    groups = hq // key.shape[1]
    # FlexAttention needs one dtype; under autocast q/k (normed in float32) and v can differ
    key, value = key.to(query.dtype), value.to(query.dtype)
    if block_mask is None:  # no [b, Hq, S, S] grid (create_block_mask would evaluate it)
        block_mask = sparse_attention_block_mask(topk, sinks, window, groups)
    if isinstance(block_mask, IntervalLayout):
        key, value, block_mask = block_mask.arrange(key), block_mask.arrange(value), block_mask.block_mask
    kw = dict(block_mask=block_mask, scale=scale)
    if softcap:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap

        kw["score_mod"] = score_mod
    if kernel_options:
        kw["kernel_options"] = kernel_options
    if groups > 1:
        kw["enable_gqa"] = True
    if hasattr(_fa, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        out, aux = training_flex(query.device)(query, key, value, return_aux=_fa.AuxRequest(lse=True), **kw)
        return out, aux.lse.float()
    out, lse = training_flex(query.device)(query, key, value, return_lse=True, **kw)
    return out, lse.float()


def sparse_attention_reference(query, key, value, topk: RunningTopK, sinks: int, window: int, scale=None,
                               softcap: float | None = None):
    """Materialised-mask reference of :func:`sparse_attention` (small sizes only)."""
    groups = query.shape[1] // key.shape[1]
    mask = expand_kv(sparse_mask_reference(topk, sinks, window), groups)
    k, v = expand_kv(key, groups), expand_kv(value, groups)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query.float() @ k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ v.float()
    return out.to(query.dtype), lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sink_logits: torch.Tensor | None):
    """Learned per-head sinks (GPT-OSS) applied to a softmax's result: one extra logit ``s_h`` per query head that
    attends to nothing scales the output by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, s_h)``.
    out ``[b, Hq, S, d]``, lse ``[b, Hq, S]`` float32, sink_logits ``[Hq]`` or None -> (out, lse')."""
    if sink_logits is None:
        return out, lse
    lse_all = torch.logaddexp(lse, sink_logits.float().to(lse.device).view(1, -1, 1))
    return out * (lse - lse_all).exp()[..., None].to(out.dtype), lse_all
