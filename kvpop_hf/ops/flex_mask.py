"""Compact per-head chunk masks for FlexAttention (no dense ``[L x C]`` mask is ever stored).

A :class:`~kvpop_hf.layer.ChunkPlan` describes, per (batch row, KV head), ``C = n_old + L``
candidates (stored slots, then the chunk's new tokens) and ``L`` queries. Query ``j`` at real
position ``q_j`` sees candidate ``c`` (real position ``p_c``, rank ``r_c`` in the plan's ``order``)
iff

* ``0 <= p_c <= q_j`` and (``p_c < s`` or ``p_c > q_j - w``)            (sinks and window), or
* ``s <= p_c <= q_j - w`` and ``r_c <= cutoff_j``                      (long-range top-k),

where ``cutoff_j`` is the rank of the k-th best candidate eligible at ``q_j`` (``C`` if fewer than
``k`` are eligible, ``-1`` if ``k == 0``). A padding query (``q_j < 0``) sees only its own new
token, candidate ``n_old + j``. That is exactly ``ChunkPlan.visibility()``.

``cutoff`` comes from :func:`chunk_cutoff`: by default :func:`blocked_chunk_cutoff`, in parallel over
blocks of queries; its variants run the running top-k machinery of :mod:`kvpop_hf.ops.running_topk` instead:
candidates are laid out as a sequence sorted by eligibility time (position), with priority ``-rank`` so
that the sequence's priority ranks are the plan's ranks, and the running top-k with ``sinks=0, window=1``
answers "k-th best among the first ``n`` candidates" for every ``n``; query ``j`` reads it at
``n_j = #{c : s <= p_c <= q_j - w}`` (a ``searchsorted``). :func:`chunk_cutoff_reference` is the plain count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["CompactChunkMask", "build_block_mask", "chunk_block_flags", "chunk_cutoff", "chunk_cutoff_reference",
           "compact_chunk_mask", "dense_from_compact"]


@dataclass
class CompactChunkMask:
    """Compact description of a chunk's visibility, everything ``O(L + C)`` per (row, KV head).

    cand_rank ``[b,h,C]`` rank of each candidate in the plan's ``order`` (0 = best);
    cand_pos ``[b,h,C]`` real positions (-1: none); query_pos ``[b,L]`` (-1: padding);
    cutoff ``[b,h,L]``; own ``[b,L]`` the candidate index of each query's own new token.
    """

    cand_rank: torch.Tensor
    cand_pos: torch.Tensor
    query_pos: torch.Tensor
    cutoff: torch.Tensor
    own: torch.Tensor
    sinks: int
    window: int

    def mask_mod(self, groups: int = 1):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``; ``h`` is a query head (KV head ``h // groups``)."""
        rank, pos, qpos, cutoff, own = self.cand_rank, self.cand_pos, self.query_pos, self.cutoff, self.own
        s, w = self.sinks, self.window

        def kvpop_mask_mod(b, h, q_idx, kv_idx):
            hk = h // groups
            q = qpos[b, q_idx]
            p = pos[b, hk, kv_idx]
            recent = (p >= 0) & (p <= q) & ((p < s) | (p > q - w))
            kept = (p >= s) & (p <= q - w) & (rank[b, hk, kv_idx] <= cutoff[b, hk, q_idx])
            return torch.where(q < 0, kv_idx == own[b, q_idx], recent | kept)

        return kvpop_mask_mod


def ranks_of(order: torch.Tensor) -> torch.Tensor:
    """``rank [..., C]``: the place of each candidate in ``order [..., C]`` (candidate indices, best first)."""
    C = order.shape[-1]
    return torch.empty_like(order).scatter_(-1, order, torch.arange(C, device=order.device).expand_as(order))


def chunk_cutoff(pos: torch.Tensor, order: torch.Tensor, query_pos: torch.Tensor, sinks: int, window: int,
                 topk: int, backend: str = "blocked", rank: torch.Tensor | None = None) -> torch.Tensor:
    """``cutoff [b,h,L]`` (int64) via the running top-k (see module docstring).

    pos ``[b,h,C]``, order ``[b,h,C]`` (candidate indices, best first), query_pos ``[b,L]``.
    ``backend`` (the private variant ``Backends._chunk_cutoff``): ``"blocked"`` (the default,
    :func:`blocked_chunk_cutoff`: parallel over query blocks) or a :func:`kvpop_hf.ops.running_topk.running_topk` backend
    (``"torch"``, ``"wavelet"``, ``"triton"``: a running top-k sweep per head); each equals
    :func:`chunk_cutoff_reference` (tests/test_flex_chunk_attention.py).
    ``rank``: :func:`ranks_of` ``(order)`` when the caller has it already.
    """
    from ..backends import resolve_choice
    from .running_topk import running_topk

    backend = resolve_choice("_chunk_cutoff", backend, pos.device)
    if backend == "blocked":
        return blocked_chunk_cutoff(pos, order, query_pos, sinks, window, topk, rank=rank)
    b, h, C = pos.shape
    L = query_pos.shape[-1]
    dev = pos.device
    if topk == 0:
        return torch.full((b, h, L), -1, dtype=torch.long, device=dev)
    rank = ranks_of(order) if rank is None else rank
    # eligibility time: candidate c becomes eligible at query position pos_c + w (never if pos_c < s)
    big = torch.iinfo(torch.long).max
    key = torch.where(pos >= sinks, pos, big)
    key_sorted, seq = key.sort(dim=-1, stable=True)  # seq[i]: candidate at sequence index i
    # priority -rank: the running top-k's ranks are the plan's ranks; a last dummy is never eligible
    pdtype = torch.float32 if C + 1 < (1 << 24) else torch.float64
    prio = torch.cat([-rank.gather(-1, seq).to(pdtype), torch.full((b, h, 1), -float(C), dtype=pdtype, device=dev)], -1)
    res = running_topk(prio, 0, 1, topk, backend=backend)  # [b,h,C+1]
    # number of candidates eligible at each query = sequence prefix length = query index with window 1
    thresh = (query_pos - window)[:, None, :].expand(b, h, L).contiguous()
    n_elig = torch.searchsorted(key_sorted.contiguous(), thresh, right=True)  # [b,h,L] in 0..C
    cutoff = res.cutoff.gather(-1, n_elig)
    return cutoff.clamp_max(C)  # "fewer than k eligible" is C + 1 there, C here


def blocked_chunk_cutoff(pos: torch.Tensor, order: torch.Tensor, query_pos: torch.Tensor, sinks: int, window: int,
                         topk: int, block: int = 128, max_tile_elems: int = 1 << 25,
                         rank: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`chunk_cutoff` computed in parallel over blocks of ``block`` queries (no sequential sweep).

    Candidates are ordered by the query position at which they become eligible; query ``j`` sees the
    first ``n_j`` of them and ``cutoff_j`` is the ``k``-th smallest rank among those (``C`` if fewer).
    The real queries of a block have consecutive positions, so their ``n_j`` lie in ``[m, m + block]``
    with ``m`` the block's smallest. Let ``A`` be the first ``m`` candidates. With ``t = n_j - m``
    newcomers the answer is the k-th smallest of ``A`` and the ``t`` newcomers, which is either a
    newcomer or one of the members of ``A`` ranked ``k - block .. k`` inside ``A`` (each newcomer below
    it pushes it down one place). So per block: ``cntA(r)`` (members of ``A`` ranked ``<= r``) by a
    cumulative sum over ranks, the ``<= 2 * block + 1`` possible answers, and for every ``t`` the
    smallest possible answer ``r`` with ``cntA(r) + #{newcomers among the first t ranked <= r} >= k``.
    ``O(L / block * C + L * block)`` work per head, a few dozen launches, tiled over query blocks."""
    b, h, C = pos.shape
    L = query_pos.shape[-1]
    dev = pos.device
    k, T = int(topk), int(block)
    if k == 0:
        return torch.full((b, h, L), -1, dtype=torch.long, device=dev)
    big = torch.iinfo(torch.long).max
    ar_C = torch.arange(C, device=dev)
    rank = ranks_of(order) if rank is None else rank
    key = torch.where(pos >= sinks, pos, big)
    key_sorted, seq = key.sort(dim=-1, stable=True)  # seq[i]: candidate at sequence index i
    rank_seq = rank.gather(-1, seq)  # ranks in eligibility order
    seq_of_rank = torch.empty_like(rank_seq).scatter_(-1, rank_seq, ar_C.expand_as(rank_seq))
    thresh = (query_pos - window)[:, None, :].expand(b, h, L).contiguous()
    n_elig = torch.searchsorted(key_sorted.contiguous(), thresh, right=True)  # [b,h,L] in 0..C
    real = (query_pos >= 0)[:, None, :].expand(b, h, L)

    Qb = -(-L // T)
    pad = Qb * T - L
    F = torch.nn.functional
    ne_blk = F.pad(n_elig, (0, pad)).view(b, h, Qb, T)
    real_blk = F.pad(real, (0, pad), value=False).view(b, h, Qb, T)
    m = torch.where(real_blk, ne_blk, big).amin(-1)
    m = torch.where(m == big, 0, m)  # blocks of padding only: any start will do
    ans = torch.empty(b, h, Qb, T + 1, dtype=torch.long, device=dev)
    lo_slot = max(k - T, 1)  # A's members ranked lo_slot .. k inside A can be answers
    ar_T = torch.arange(T, device=dev)
    rows = max(1, max_tile_elems // max(b * h * max(C, (T + 1) * (2 * T + 2)), 1))
    for r0 in range(0, Qb, rows):
        r1 = min(Qb, r0 + rows)
        mt = m[:, :, r0:r1, None]  # [b,h,R,1]
        in_a = seq_of_rank[:, :, None, :] < mt  # [b,h,R,C] indexed by rank
        cnt_a = in_a.cumsum(-1)
        win_slot = torch.where(in_a & (cnt_a >= lo_slot) & (cnt_a <= k), cnt_a - lo_slot, T + 1)
        win = torch.full((b, h, r1 - r0, T + 2), big, dtype=torch.long, device=dev)
        win.scatter_(-1, win_slot, ar_C.expand_as(win_slot))
        new_at = mt + ar_T  # sequence indices of the next T candidates
        new_r = torch.where(new_at < C, rank_seq[:, :, None, :].expand(b, h, r1 - r0, C).gather(
            -1, new_at.clamp_max(C - 1)), big)  # [b,h,R,T]
        cands = torch.cat([win[..., :T + 1], new_r], -1).sort(-1).values  # [b,h,R,2T+1]
        size_a = mt.clamp_max(C)
        cnt_at = torch.where(cands < C, cnt_a.gather(-1, cands.clamp_max(C - 1)), size_a)
        below = (new_r[..., :, None] <= cands[..., None, :]).cumsum(-2)  # [b,h,R,T,2T+1]: first u+1 newcomers
        total = torch.cat([cnt_at[..., None, :], cnt_at[..., None, :] + below], -2)  # t = 0..T
        hit = total >= k
        first = hit.long().argmax(-1)  # [b,h,R,T+1]
        found = hit.any(-1)
        ans[:, :, r0:r1] = torch.where(found, cands.gather(-1, first), C).clamp_max(C)
    t = (ne_blk - m[..., None]).clamp(0, T)  # newcomers seen by each query of the block
    cut = ans.gather(-1, t).view(b, h, Qb * T)[..., :L]
    return torch.where(real, cut, C)  # a padding query sees nothing eligible


def chunk_cutoff_reference(pos: torch.Tensor, order: torch.Tensor, query_pos: torch.Tensor, sinks: int,
                           window: int, topk: int) -> torch.Tensor:
    """Plain ``O(L*C)`` reference of :func:`chunk_cutoff` (the same count as ``visibility()``)."""
    b, h, C = pos.shape
    L = query_pos.shape[-1]
    if topk == 0:
        return torch.full((b, h, L), -1, dtype=torch.long, device=pos.device)
    pos_sorted = pos.gather(-1, order)[:, :, None, :]
    q = query_pos[:, None, :, None]
    elig = (pos_sorted >= sinks) & (pos_sorted <= q - window)
    reached = elig.long().cumsum(-1) >= topk  # [b,h,L,C]
    first = reached.long().argmax(-1)
    return torch.where(reached.any(-1), first, C)


def compact_chunk_mask(pos, order, query_pos, sinks, window, topk, reference: bool = False,
                       backend: str = "blocked") -> CompactChunkMask:
    b, h, C = pos.shape
    L = query_pos.shape[-1]
    dev = pos.device
    rank = ranks_of(order)
    if reference:
        cutoff = chunk_cutoff_reference(pos, order, query_pos, sinks, window, topk)
    else:
        cutoff = chunk_cutoff(pos, order, query_pos, sinks, window, topk, backend, rank=rank)
    own = (C - L + torch.arange(L, device=dev)).expand(b, L)
    return CompactChunkMask(rank, pos, query_pos, cutoff, own, sinks, window)


def dense_from_compact(cm: CompactChunkMask, groups: int = 1) -> torch.Tensor:
    """Evaluate the mask_mod on the full grid, ``[b, h*groups, L, C]`` bool (tests / debugging)."""
    b, h, C = cm.cand_pos.shape
    L = cm.query_pos.shape[-1]
    dev = cm.cand_pos.device
    mod = cm.mask_mod(groups)
    bi = torch.arange(b, device=dev).view(b, 1, 1, 1)
    hi = torch.arange(h * groups, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(L, device=dev).view(1, 1, L, 1)
    ki = torch.arange(C, device=dev).view(1, 1, 1, C)
    return mod(bi, hi, qi, ki).expand(b, h * groups, L, C)


def _ordered(dense: torch.Tensor):
    """Block-sparse rows from a dense ``[..., Qb, Kb]`` 0/1 map: (count ``[..., Qb]``, indices ``[..., Qb, Kb]``)."""
    num = dense.sum(-1).to(torch.int32).contiguous()
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
    return num, idx


def build_block_mask(cm: CompactChunkMask, groups: int, block: int = 128):
    """The FlexAttention ``BlockMask`` of ``cm`` for ``H = h * groups`` query heads, from the analytic
    per-block flags of :func:`chunk_block_flags` (``O(L/block * C)`` work per head, no ``L x C`` grid)."""
    b, h, C = cm.cand_pos.shape
    L = cm.query_pos.shape[-1]
    partial, full = chunk_block_flags(cm, block)
    if groups > 1:
        partial, full = partial.repeat_interleave(groups, 1), full.repeat_interleave(groups, 1)
    return block_mask_from_flags(partial, full, L, C, cm.mask_mod(groups), block)


def chunk_block_flags(cm: CompactChunkMask, block: int = 128, max_tile_elems: int = 1 << 25):
    """Per-block (partial, full) flags ``[b, h, Qb, Kb]`` of a chunk's visibility, without the grid.

    The real queries of a row have consecutive positions (padding takes none), so the real queries
    of a query block cover positions ``[qmin, qmax]``. Candidate ``c`` (position ``p``, rank ``r``) is
    seen by some query of the block iff ``0 <= p <= qmax`` and (``p < s``, or ``qmin < p + w`` (the
    window), or ``s <= p <= qmax - w`` and ``r <= `` the largest cutoff among the queries at
    positions ``>= p + w``); by all of them iff ``0 <= p <= qmin`` and (``p < s``, or ``p + w > qmax``,
    or ``r <=`` the smallest such cutoff). Cutoffs are laid out by position offset inside the block,
    so these are suffix max/min lookups. A padding query sees only its own token (never full).
    Blocks past ``L`` or ``C`` count as masked, as in ``create_block_mask``. Equal to the blocks of
    :func:`dense_from_compact` (tests compare them with :func:`tiled_block_mask`)."""
    rank, pos, qpos, cutoff, own = cm.cand_rank, cm.cand_pos, cm.query_pos, cm.cutoff, cm.own
    s, w = int(cm.sinks), int(cm.window)
    b, h, C = pos.shape
    L = qpos.shape[-1]
    dev = pos.device
    Qb, Kb = -(-L // block), -(-C // block)
    Lp, Cp = Qb * block, Kb * block
    big = 1 << 62
    F = torch.nn.functional
    qp = F.pad(qpos, (0, Lp - L), value=-1).view(b, Qb, block)
    real = qp >= 0
    qmin = torch.where(real, qp, big).amin(-1)  # [b, Qb]
    qmax = torch.where(real, qp, -1).amax(-1)
    not_full_rows = (~real).any(-1)  # padding queries or the tail past L
    # cutoffs by position offset inside each block (the real queries fill offsets 0 .. n_real - 1)
    offset = torch.where(real, qp - qmin[..., None], block)[:, None].expand(b, h, Qb, block)
    cut = F.pad(cutoff.long(), (0, Lp - L)).view(b, h, Qb, block)
    by_off_max = torch.full((b, h, Qb, block + 1), -big, dtype=torch.long, device=dev).scatter_(-1, offset, cut)
    by_off_min = torch.full((b, h, Qb, block + 1), big, dtype=torch.long, device=dev).scatter_(-1, offset, cut)
    suf_max = by_off_max[..., :block].flip(-1).cummax(-1).values.flip(-1)
    suf_min = by_off_min[..., :block].flip(-1).cummin(-1).values.flip(-1)

    p = F.pad(pos.long(), (0, Cp - C), value=-1)[:, :, None, :]  # [b,h,1,Cp]
    r = F.pad(rank.long(), (0, Cp - C), value=big)[:, :, None, :]
    in_range = (torch.arange(Cp, device=dev) < C).view(1, 1, 1, Cp)
    partial = torch.empty(b, h, Qb, Kb, dtype=torch.bool, device=dev)
    full = torch.empty_like(partial)
    rows = max(1, max_tile_elems // max(b * h * Cp, 1))
    for r0 in range(0, Qb, rows):
        r1 = min(Qb, r0 + rows)
        lo, hi = qmin[:, None, r0:r1, None], qmax[:, None, r0:r1, None]  # [b,1,R,1]
        first_lr = (p + w - lo).clamp(0, block - 1).expand(b, h, r1 - r0, Cp)
        smax = suf_max[:, :, r0:r1].gather(-1, first_lr)
        smin = suf_min[:, :, r0:r1].gather(-1, first_lr)
        some = (p >= 0) & (p <= hi) & ((p < s) | (lo < p + w) | ((p >= s) & (p + w <= hi) & (r <= smax)))
        every = in_range & (p >= 0) & (p <= lo) & ((p < s) | (p + w > hi) | (r <= smin))
        R = r1 - r0
        full[:, :, r0:r1] = every.view(b, h, R, Kb, block).all(-1) & ~not_full_rows[:, None, r0:r1, None]
        partial[:, :, r0:r1] = some.view(b, h, R, Kb, block).any(-1)
    # a padding query sees its own token (a whole block only when blocks are single entries)
    pad_q = (qpos < 0).nonzero(as_tuple=True)  # (rows, query index)
    if pad_q[0].numel():
        (full if block == 1 else partial)[pad_q[0], :, pad_q[1] // block, own[pad_q] // block] = True
    return partial & ~full, full


def tiled_block_mask(kv_mask_mod, b: int, h: int, L: int, C: int, groups: int, mask_mod, device,
                     block: int = 128, max_tile_elems: int = 1 << 22):
    """A ``BlockMask`` built tile by tile, never holding the whole ``[b, Hq, L, C]`` grid.

    ``create_block_mask`` evaluates the mask on the whole grid (its compiled version too, as of
    torch 2.11, allocates it). Here ``kv_mask_mod(b, h, q, kv)`` is evaluated per KV head
    ``h`` on tiles of whole query blocks (at most ``max_tile_elems`` entries at a time, at least one
    block row) and reduced to per-block partial/full flags, the flags ``create_block_mask`` gives;
    ``mask_mod`` (indexed by query head, ``Hq = h * groups``) is what FlexAttention applies inside
    partial blocks. ``b``/``h`` may be 1 for a mask shared by all batch rows/heads."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = device
    Qb, Kb = -(-L // block), -(-C // block)
    Cp = Kb * block
    partial = torch.zeros(b, h, Qb, Kb, dtype=torch.int8, device=dev)
    full = torch.zeros_like(partial)
    rows = max(1, max_tile_elems // max(b * h * Cp * block, 1))  # query blocks per tile
    bi = torch.arange(b, device=dev).view(b, 1, 1, 1)
    hi = torch.arange(h, device=dev).view(1, h, 1, 1)
    ki = torch.arange(Cp, device=dev).view(1, 1, 1, Cp)
    for r0 in range(0, Qb, rows):
        r1 = min(Qb, r0 + rows)
        qi = torch.arange(r0 * block, r1 * block, device=dev).view(1, 1, -1, 1)
        inside = (qi < L) & (ki < C)  # padding of the last blocks counts as masked, as in create_block_mask
        m = kv_mask_mod(bi, hi, qi.clamp_max(L - 1), ki.clamp_max(C - 1)) & inside
        m = m.expand(b, h, (r1 - r0) * block, Cp)
        s = m.reshape(b, h, r1 - r0, block, Kb, block).sum((3, 5), dtype=torch.int32)
        full[:, :, r0:r1] = s == block * block
        partial[:, :, r0:r1] = (s > 0) & (s < block * block)
    if groups > 1:
        partial, full = partial.repeat_interleave(groups, 1), full.repeat_interleave(groups, 1)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod, seq_lengths=(L, C))


def block_mask_from_flags(partial: torch.Tensor, full: torch.Tensor, L: int, C: int, mask_mod, block: int = 128,
                          backward: bool = True):
    """``BlockMask`` from per-block partial/full 0/1 maps ``[b, H, Qb, Kb]`` (the flags ``create_block_mask`` gives).
    ``backward=False`` skips the transposed (query-major) indices that only a backward pass reads."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx = _ordered(partial.to(torch.int8))
    full_num, full_idx = _ordered(full.to(torch.int8))
    extra = {} if backward or not _has_compute_q_blocks() else {"compute_q_blocks": False}
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod, seq_lengths=(L, C), **extra)


@functools.lru_cache(maxsize=None)
def _has_compute_q_blocks() -> bool:
    """Whether this torch's ``BlockMask.from_kv_blocks`` can skip the backward indices (asked once, on first use)."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
