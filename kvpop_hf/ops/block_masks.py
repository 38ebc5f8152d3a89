"""Block masks of the training passes, built from per-block flags without an ``S x S`` grid.

* :func:`sparse_block_mask`: the student's running top-k mask (sinks, window, and the keys whose rank is within the
  query's cutoff), for the sparse attention of :mod:`.sparse_attention`;
* :func:`future_block_mask`: the transposed future-attention mask of the target pass (:mod:`.targets`).
"""

from __future__ import annotations

import torch

from .flex_mask import block_mask_from_flags

__all__ = ["future_block_flags", "future_block_mask", "sparse_block_flags", "sparse_block_mask"]


def sparse_block_flags(rank: torch.Tensor, cutoff: torch.Tensor, sinks: int, window: int, block: int = 128,
                       max_tile_elems: int = 1 << 22):
    """Per-block (partial, full) flags ``[b, h, Qb, Kb]`` (bool) of the running top-k mask, computed analytically.

    Mask (``kvpop_hf.ops.running_topk.sparse_mask_reference``): query ``q`` sees key ``t`` iff ``t <= q`` and (``t < s`` or
    ``q - t < w`` or (``s <= t <= q - w`` and ``rank[t] <= cutoff[q]``)). For a query block ``[q0, q1]`` and a key
    ``t`` the long-range queries are ``[max(q0, t + w), q1]``; some of them keep ``t`` iff the suffix max of
    ``cutoff`` from there is ``>= rank[t]``, all of them iff its suffix min is. So the flags need only
    ``O(S * S / block)`` work per head (tiled: at most ``max_tile_elems`` (row, key) pairs at a time) and no
    ``S x S`` grid; no assumption on ``cutoff`` (monotone or not). Padding (last partial blocks) counts as masked,
    as in ``create_block_mask``. rank ``[b, h, S]`` (per key), cutoff ``[b, h, S]`` (per query).
    """
    b, h, S = rank.shape
    dev = rank.device
    s, w = int(sinks), int(window)
    Qb = Kb = -(-S // block)
    P = Qb * block
    i64 = torch.iinfo(torch.long)
    rank = rank.long()
    cutoff = cutoff.long()
    pad = P - S
    cb_max = torch.nn.functional.pad(cutoff, (0, pad), value=i64.min).view(b, h, Qb, block)
    cb_min = torch.nn.functional.pad(cutoff, (0, pad), value=i64.max).view(b, h, Qb, block)
    # suffix max / min of cutoff inside each query block
    suf_max = cb_max.flip(-1).cummax(-1).values.flip(-1)
    suf_min = cb_min.flip(-1).cummin(-1).values.flip(-1)
    rank_p = torch.nn.functional.pad(rank, (0, pad), value=0)  # [b,h,P]
    t = torch.arange(P, device=dev)
    valid_t = t < S
    partial = torch.empty(b, h, Qb, Kb, dtype=torch.bool, device=dev)
    full = torch.empty_like(partial)
    rows = max(1, max_tile_elems // max(b * h * P, 1))
    for r0 in range(0, Qb, rows):
        r1 = min(Qb, r0 + rows)
        q0 = torch.arange(r0, r1, device=dev)[:, None] * block  # [R,1]
        q1 = (q0 + block).clamp_max(S) - 1
        tt = t[None, :]  # [1,P]
        lo = torch.maximum(q0, tt + w)  # first long-range query of t in the block
        longrange = (tt >= s) & (lo <= q1)  # [R,P]
        off = (lo - q0).clamp(0, block - 1).expand(b, h, -1, -1)
        smax = suf_max[:, :, r0:r1].gather(-1, off)  # [b,h,R,P]
        smin = suf_min[:, :, r0:r1].gather(-1, off)
        rk = rank_p[:, :, None, :]
        short = (tt < s) | (q0 - tt < w)  # t sink, or seen through the window by some query of the block
        any_ = (valid_t & (tt <= q1)) & (short | (longrange & (rk <= smax)))
        all_ = (valid_t & (tt <= q0) & (q1 - q0 == block - 1)) & ((tt < s) | ~longrange | (rk <= smin))
        R = r1 - r0
        a = any_.view(b, h, R, Kb, block).any(-1)
        f = all_.view(b, h, R, Kb, block).all(-1)
        full[:, :, r0:r1] = f
        partial[:, :, r0:r1] = a & ~f
    return partial, full


def sparse_block_mask(rank: torch.Tensor, cutoff: torch.Tensor, sinks: int, window: int, groups: int, mask_mod,
                      block: int = 128, max_tile_elems: int = 1 << 22):
    """The ``BlockMask`` of the running top-k mask for ``Hq = h * groups`` query heads, from
    :func:`sparse_block_flags` (same blocks as ``create_block_mask`` / :func:`tiled_block_mask`)."""
    S = rank.shape[-1]
    partial, full = sparse_block_flags(rank, cutoff, sinks, window, block, max_tile_elems)
    if groups > 1:
        partial, full = partial.repeat_interleave(groups, 1), full.repeat_interleave(groups, 1)
    return block_mask_from_flags(partial, full, S, S, mask_mod, block)


def future_block_flags(S: int, window: int, device, block: int = 128):
    """(partial, full) ``[1, 1, Qb, Kb]`` of the transposed target mask ``kv_idx >= q_idx + window`` (flex query =
    original key ``t``, flex key = original query ``d``): ``O((S / block)^2)`` integers, no grid."""
    nb = -(-S // block)
    i = torch.arange(nb, device=device)
    q0, k0 = i[:, None] * block, i[None, :] * block
    q1, k1 = (q0 + block).clamp_max(S) - 1, (k0 + block).clamp_max(S) - 1
    complete = (q1 - q0 == block - 1) & (k1 - k0 == block - 1)
    any_ = k1 >= q0 + window
    full = any_ & complete & (k0 >= q1 + window)
    return (any_ & ~full)[None, None], full[None, None]


def future_block_mask(S: int, window: int, mask_mod, device, block: int = 128):
    """The ``BlockMask`` of :func:`future_block_flags`."""
    partial, full = future_block_flags(S, window, device, block)
    return block_mask_from_flags(partial, full, S, S, mask_mod, block)
