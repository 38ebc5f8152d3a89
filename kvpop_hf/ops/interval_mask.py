"""A prompt chunk's visibility as one interval of queries per candidate, and a key layout that makes it sparse.

Under static priorities a candidate, once evicted, never returns, and a token enters the long-range set only
as it leaves the window (docs/design.md §1). So the real queries that see candidate ``c`` are consecutive:
query ``j`` (real position ``q_j``) sees ``c`` iff ``start_c <= j < end_c`` with

* ``start_c`` the first real query at or after the candidate's position ``p_c`` (``L``: never);
* ``end_c = L`` for a sink (``p_c < s``); otherwise ``end_c = max(j0, j1)`` where ``j0`` is the first real
  query with ``q_j >= p_c + w`` (the window ends) and ``j1`` the first with ``cutoff_j < rank_c`` (``cutoff``, the
  rank of the k-th best eligible candidate, never increases along the real queries, so once a candidate drops
  out it stays out).

A padding query (``q_j < 0``) sees only its own new token; its candidate gets the interval ``[j, j + 1)``.

FlexAttention skips a ``128 x 128`` block only when no query of the block sees any key of the block. In
position order nearly every past block holds a long-range survivor, so nearly every block is visited although
each query sees at most ``B = s + w + k`` keys. :func:`interval_layout` reorders the candidates by
``(start_c // segment, -end_c)``: inside a segment of earlier candidates the ones still alive at a query come
first, so a query block visits about ``B / 128`` mostly full blocks, one boundary block per earlier segment and
the blocks of its own segment. ``O(L + C log C)`` work per (row, KV head), no ``L x C`` grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .flex_mask import CompactChunkMask, block_mask_from_flags

__all__ = ["IntervalChunkMask", "interval_block_flags", "interval_block_mask", "interval_chunk_mask",
           "interval_layout", "interval_visibility"]


@dataclass
class IntervalChunkMask:
    """The chunk's visibility as intervals. start/end ``[b,h,C]`` int64 (query indices: query ``j`` sees
    candidate ``c`` iff ``start_c <= j < end_c``), pad ``[b,h,C]`` bool (the candidate is a padding query's own
    token, interval ``[j, j+1)``), query_pos ``[b,L]`` (-1: padding), perm ``[b,h,C]`` the plan's candidate
    index at each place of this layout (the identity in plan order)."""

    start: torch.Tensor
    end: torch.Tensor
    pad: torch.Tensor
    query_pos: torch.Tensor
    perm: torch.Tensor

    def mask_mod(self, groups: int = 1):
        start, end, pad, qpos = self.start, self.end, self.pad, self.query_pos

        def interval_mask_mod(b, h, q_idx, kv_idx):
            hk = h // groups
            st = start[b, hk, kv_idx]
            inside = (st <= q_idx) & (q_idx < end[b, hk, kv_idx])
            # a padding query sees only its own token; a real query never sees a padding token's
            return inside & ((qpos[b, q_idx] >= 0) == ~pad[b, hk, kv_idx])

        return interval_mask_mod


def interval_chunk_mask(cm: CompactChunkMask) -> IntervalChunkMask:
    """The intervals of :class:`~kvpop_hf.ops.flex_mask.CompactChunkMask` ``cm`` (candidates in plan order: the
    ``n_old`` stored slots, then the ``L`` new tokens, so ``cm.own[b, j] = C - L + j``)."""
    rank, pos, qpos, cutoff = cm.cand_rank, cm.cand_pos, cm.query_pos, cm.cutoff
    s, w = int(cm.sinks), int(cm.window)
    b, h, C = pos.shape
    L = qpos.shape[-1]
    dev = pos.device
    real = qpos >= 0  # [b, L]
    # positions filled forward over padding: nondecreasing, and increasing at every real query
    qfill = qpos.cummax(-1).values[:, None, :].expand(b, h, L).contiguous()
    p = pos.long()
    start = torch.searchsorted(qfill, p.clamp_min(0).contiguous())
    j0 = torch.searchsorted(qfill, (p + w).contiguous())
    big = torch.iinfo(torch.long).max
    cut = torch.where(real[:, None, :], cutoff.long(), big).cummin(-1).values  # [b,h,L], nonincreasing
    j1 = torch.searchsorted((-cut).contiguous(), (-rank.long()).contiguous(), right=True)
    end = torch.where(p < s, L, torch.maximum(j0, j1))
    start = torch.where(p >= 0, start, L)
    end = torch.where(p >= 0, end, 0)
    # the own token of a padding query j is the new candidate C - L + j (cm.own): interval [j, j+1); no host sync
    pad_q = ~real[:, None, :]  # [b,1,L]
    j = torch.arange(L, device=dev)
    pad = torch.cat([torch.zeros(b, h, C - L, dtype=torch.bool, device=dev), pad_q.expand(b, h, L)], -1)
    start = torch.cat([start[..., :C - L], torch.where(pad_q, j, start[..., C - L:])], -1)
    end = torch.cat([end[..., :C - L], torch.where(pad_q, j + 1, end[..., C - L:])], -1)
    ident = torch.arange(C, device=dev).expand(b, h, C)
    return IntervalChunkMask(start, end, pad, qpos, ident)


def interval_layout(im: IntervalChunkMask, segment: int = 1024) -> IntervalChunkMask:
    """The same mask with the candidates reordered by ``(start // segment, -end)`` (stable): gather keys and
    values with ``perm`` (``[b,h,C]``) before attending."""
    L = im.query_pos.shape[-1]
    group = torch.div(im.start, segment, rounding_mode="floor")  # start = L (never seen): the last group
    key = group * (L + 2) + (L + 1 - im.end)
    perm = key.argsort(dim=-1, stable=True)
    take = lambda t: t.gather(-1, perm)  # noqa: E731
    return IntervalChunkMask(take(im.start), take(im.end), take(im.pad), im.query_pos, im.perm.gather(-1, perm))


def interval_visibility(im: IntervalChunkMask) -> torch.Tensor:
    """The mask on the whole grid, ``[b, h, L, C]`` bool, in the layout's candidate order (tests)."""
    L = im.query_pos.shape[-1]
    j = torch.arange(L, device=im.start.device).view(1, 1, L, 1)
    inside = (im.start[:, :, None, :] <= j) & (j < im.end[:, :, None, :])
    real_q = (im.query_pos >= 0)[:, None, :, None]
    return inside & (real_q == ~im.pad[:, :, None, :])


def interval_block_flags(im: IntervalChunkMask, block: int = 128):
    """(partial, full) ``[b, h, Qb, Kb]`` bool from per-key-block interval bounds.

    Full: every key of the block has ``start <= `` the block's first query and ``end > `` its last, the query
    block is all real queries and both blocks are complete. Partial (visited with the mask applied): not full,
    and some key may be seen, i.e. the block's smallest ``start <= `` the last query and its largest ``end > ``
    the first query (a superset of the exact blocks; the mask decides inside)."""
    start, end, qpos = im.start, im.end, im.query_pos
    b, h, C = start.shape
    L = qpos.shape[-1]
    dev = start.device
    Qb, Kb = -(-L // block), -(-C // block)
    F = torch.nn.functional
    st = F.pad(start, (0, Kb * block - C), value=L + 1).view(b, h, Kb, block)
    en = F.pad(end, (0, Kb * block - C), value=-1).view(b, h, Kb, block)
    smin, smax = st.amin(-1), st.amax(-1)  # [b,h,Kb]
    emin, emax = en.amin(-1), en.amax(-1)
    q0 = torch.arange(Qb, device=dev) * block  # first query index of each block
    q1 = (q0 + block).clamp_max(L) - 1
    real_block = F.pad(qpos >= 0, (0, Qb * block - L), value=False).view(b, Qb, block).all(-1)  # [b,Qb]
    some = (smin[:, :, None, :] <= q1[None, None, :, None]) & (emax[:, :, None, :] > q0[None, None, :, None])
    every = (smax[:, :, None, :] <= q0[None, None, :, None]) & (emin[:, :, None, :] > q1[None, None, :, None])
    full = every & real_block[:, None, :, None]
    return some & ~full, full


def interval_block_mask(im: IntervalChunkMask, groups: int, block: int = 128):
    """FlexAttention ``BlockMask`` of ``im`` for ``h * groups`` query heads (inference: no backward indices)."""
    C = im.start.shape[-1]
    L = im.query_pos.shape[-1]
    partial, full = interval_block_flags(im, block)
    if groups > 1:
        partial, full = partial.repeat_interleave(groups, 1), full.repeat_interleave(groups, 1)
    return block_mask_from_flags(partial, full, L, C, im.mask_mod(groups), block, backward=False)
