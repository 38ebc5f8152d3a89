"""The training sparse attention's keys reordered so that each query block visits few, mostly full key blocks.

Under the running top-k (docs/design.md §6) each key ``t`` is seen by one run of consecutive queries: from
``t`` itself through the window, then, if its rank is within the cutoff when it leaves the window, until the
first query whose cutoff drops below its rank (``cutoff`` never increases along the queries, so a key once
dropped never returns). With ``end_t`` that first query (``S`` for a sink, ``t + w`` for a key never kept):

    ``M[q, t] = start_t <= q < end_t``, ``start_t = t``, ``end_t = max(t + w, j1_t)``,
    ``j1_t = min{q : cutoff[q] < rank[t]}``,

the mask of :func:`kvpop_hf.ops.running_topk.sparse_mask_reference`, as intervals. In position order nearly every
``128 x 128`` block holds a long-range survivor, so FlexAttention visits every block below the diagonal,
each with the mask applied, although a query sees at most ``B = s + w + k`` keys. Reordering the keys by
``(start // segment, -end)`` (per row and KV head; attention does not depend on the order of its keys) puts,
inside each segment of earlier keys, the ones still alive at a query first: a query block then visits about
``B / 128`` mostly full blocks, one boundary block per earlier segment and the blocks of its own segment
(the same layout as the prompt chunks of inference, :mod:`kvpop_hf.ops.interval_mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .flex_mask import block_mask_from_flags
from .interval_mask import IntervalChunkMask, interval_block_flags, interval_layout
from .running_topk import RunningTopK

__all__ = ["IntervalLayout", "default_segment", "interval_sparse_layout", "sequence_intervals"]


@dataclass
class IntervalLayout:
    """Keys of a whole sequence in the interval order.

    perm ``[b, Hkv, S]`` int64: the key (position) at each place; start/end ``[b, Hkv, S]`` int32 the interval of
    queries that see the key at each place; block_mask: the FlexAttention ``BlockMask`` over the reordered keys
    (with the indices its backward pass reads)."""

    perm: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    block_mask: object

    def arrange(self, key: torch.Tensor) -> torch.Tensor:
        """``key [b, Hkv, S, d]`` in position order -> the same keys in this layout's order (differentiable)."""
        return key.gather(2, self.perm[..., None].expand(-1, -1, -1, key.shape[-1]))


def sequence_intervals(topk: RunningTopK, sinks: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) ``[b, h, S]`` int64 of each key in position order (module docstring): query ``q`` sees key
    ``t`` iff ``start[t] <= q < end[t]``. rank ``[b, h, S]`` per key, cutoff ``[b, h, S]`` per query."""
    rank, cutoff = topk.rank.long(), topk.cutoff.long()
    S = rank.shape[-1]
    t = torch.arange(S, device=rank.device).expand_as(rank)
    # j1 = the number of queries whose cutoff is >= rank (cutoff is nonincreasing): searchsorted on -cutoff
    j1 = torch.searchsorted((-cutoff).contiguous(), (-rank).contiguous(), right=True)
    end = torch.where(t < sinks, S, torch.maximum(t + window, j1)).clamp_max(S)
    return t.contiguous(), end


def default_segment(seq_len: int, block: int = 128) -> int:
    """The power of two nearest ``sqrt(S * block)`` (within 256..8192): a query block visits about ``S / segment``
    boundary blocks and ``segment / block`` blocks of its own segment, fewest where the two are equal (1024 at
    8k, 2048 at 32k, 4096 at 128k)."""
    return 1 << min(13, max(8, round(math.log2(max(seq_len * block, 1)) / 2)))


def interval_sparse_layout(topk: RunningTopK, sinks: int, window: int, groups: int, segment: int | None = None,
                           block: int = 128) -> IntervalLayout:
    """The :class:`IntervalLayout` of the running top-k ``topk`` for ``Hq = Hkv * groups`` query heads;
    ``segment``: :func:`default_segment` of the sequence length if None."""
    start, end = sequence_intervals(topk, sinks, window)
    b, h, S = start.shape
    segment = default_segment(S, block) if segment is None else int(segment)
    qpos = torch.arange(S, device=start.device).expand(b, S)
    ident = torch.arange(S, device=start.device).expand(b, h, S)
    im = interval_layout(IntervalChunkMask(start, end, torch.zeros_like(start, dtype=torch.bool), qpos, ident),
                         segment)
    partial, full = interval_block_flags(im, block)
    if groups > 1:
        partial, full = partial.repeat_interleave(groups, 1), full.repeat_interleave(groups, 1)
    st, en = im.start.to(torch.int32).contiguous(), im.end.to(torch.int32).contiguous()

    def interval_mask_mod(bi, hq, q_idx, kv_idx):
        hk = hq // groups
        return (st[bi, hk, kv_idx] <= q_idx) & (q_idx < en[bi, hk, kv_idx])

    mask = block_mask_from_flags(partial, full, S, S, interval_mask_mod, block)
    return IntervalLayout(im.perm.contiguous(), st, en, mask)
