"""Running top-k with a Fenwick tree over priority ranks (Triton).

Implements the O(S log S)-per-row running top-k of KVpop (arXiv:2607.05061,
section on efficient training): ranks are computed once with a torch sort,
then one Triton program per row (batch x KV head) sweeps the queries
``q = 0..S-1``.  At each query the newcomer ``t_new = q - window`` (if
``t_new >= sinks``) is inserted into a Fenwick tree indexed by rank; the
k-th smallest inserted rank is found by binary lifting in O(log S).  The
tree lives in a global int32 scratch buffer ``[rows, S + 1]`` (O(S) memory
per row).

This module imports triton at import time (an ImportError naming the fix
without it); ``kvpop_hf.ops.running_topk`` imports this module on the first use of the
``"triton"`` backend.  ``TRITON_INTERPRET=1`` must be set *before* the first
import to run the kernel on CPU through the Triton interpreter.
"""

from __future__ import annotations

import torch

from ..kernels import require_triton
from .reference import RunningTopK, _ranks_and_order, _validate

triton, tl = require_triton("The running top-k backend 'triton'", hint="; or use the backend 'wavelet' or 'torch'")

__all__ = ["running_topk_triton"]


@triton.jit
def _fenwick_kth(tree_row, kk, R, LOG):
    """0-based rank of the kk-th smallest inserted rank (``R`` if fewer than kk).

    Binary lifting: find the largest ``pos`` with ``prefix(pos) < kk``; the
    answer is 1-based index ``pos + 1``, i.e. rank ``pos``.  Requires
    ``2**LOG > R``.
    """
    pos = kk * 0
    rem = kk
    for j in range(LOG):
        step = 1 << (LOG - 1 - j)
        nxt = pos + step
        inb = nxt <= R
        v = tl.load(tree_row + nxt, mask=inb, other=0)
        go = inb & (v < rem)
        pos = tl.where(go, nxt, pos)
        rem = tl.where(go, rem - v, rem)
    return pos


@triton.jit(do_not_specialize=["S", "R", "ORDER_STRIDE", "sinks", "window", "k", "LOG"])
def _running_topk_kernel(
    rank_ptr,  # [rows, S] int32, -1 for sinks
    order_ptr,  # [rows, max(R, 1)] int32, token index of each rank
    tree_ptr,  # [rows, S + 1] int32 zero-initialised scratch (Fenwick, 1-based)
    cutoff_ptr,  # [rows, S] int64 out
    boundary_ptr,  # [rows, S] int64 out
    keep_ptr,  # [rows, S] int8 out
    S,
    R,
    ORDER_STRIDE,
    sinks,
    window,
    k,
    LOG,
):
    row = tl.program_id(0).to(tl.int64)
    rank_row = rank_ptr + row * S
    order_row = order_ptr + row * ORDER_STRIDE
    tree_row = tree_ptr + row * (S + 1)
    out_off = row * S
    count = k * 0  # |E(q-1)|: number of inserted ranks
    prev = k * 0 + R  # k-th smallest rank of E(q-1), R if |E(q-1)| < k
    for q in range(S):
        t_new = q - window
        has_new = t_new >= sinks
        # Boundary, read before inserting the newcomer: the k-th best incumbent
        # of E(q-1).  That is exactly the k-th smallest rank after the previous
        # insertion, so it is carried in a register instead of re-queried.
        valid = has_new & (count >= k) & (k >= 1)
        b_tok = tl.load(order_row + prev, mask=valid, other=-1)
        r_new = tl.load(rank_row + t_new, mask=has_new, other=0)
        keep = valid & (r_new < prev)
        # Fenwick insert of r_new (1-based index r_new + 1); <= LOG + 1 levels.
        i = r_new + 1
        for _j in range(LOG + 1):
            m = has_new & (i <= R)
            v = tl.load(tree_row + i, mask=m, other=0)
            tl.store(tree_row + i, v + 1, mask=m)
            i = i + (i & -i)
        # Make the scratch writes visible to every thread of the program
        # before the lifting reads them (no-op in the interpreter).
        tl.debug_barrier()
        count = count + has_new.to(tl.int32)
        cur = _fenwick_kth(tree_row, k, R, LOG)
        cut = tl.where(count >= k, cur, S)
        cut = tl.where(k == 0, -1, cut)
        tl.store(cutoff_ptr + out_off + q, cut.to(tl.int64))
        tl.store(boundary_ptr + out_off + q, tl.where(valid, b_tok, -1).to(tl.int64))
        tl.store(keep_ptr + out_off + q, keep.to(tl.int8))
        prev = cur


# Whether triton.jit produced an interpreter function (TRITON_INTERPRET=1 at import).
_INTERPRETED = type(_running_topk_kernel).__name__ == "InterpretedFunction"


def _is_interpreted() -> bool:
    return _INTERPRETED


def running_topk_triton(prio: torch.Tensor, sinks: int, window: int, k: int) -> RunningTopK:
    """Running top-k via the Triton Fenwick-tree kernel (one program per row).

    Args:
        prio: ``[..., S]`` float priorities (e.g. ``[B, H, S]``); CUDA tensor,
            or CPU tensor with ``TRITON_INTERPRET=1`` set before import.
        sinks, window, k: as in :func:`running_topk_reference`.

    Returns:
        :class:`RunningTopK` with ``[..., S]`` tensors, identical to the
        reference.
    """
    sinks, window, k = _validate(prio, sinks, window, k)
    if not prio.is_cuda and not _is_interpreted():
        raise ValueError(
            "running_topk_triton needs a CUDA tensor, or TRITON_INTERPRET=1 set "
            "before kvpop_hf.ops.running_topk.fenwick_triton is first imported"
        )
    shape = prio.shape
    S = shape[-1]
    if S >= 2**30:
        raise ValueError(f"sequence length {S} too large for int32 ranks")
    dev = prio.device
    rank, order = _ranks_and_order(prio.detach(), sinks)
    rank2 = rank.reshape(-1, S)
    rows = rank2.shape[0]
    R = order.shape[-1]
    cutoff = torch.empty(rows, S, dtype=torch.int64, device=dev)
    boundary = torch.empty(rows, S, dtype=torch.int64, device=dev)
    keep = torch.empty(rows, S, dtype=torch.int8, device=dev)
    if rows > 0 and S > 0:
        rank32 = rank2.to(torch.int32).contiguous()
        order_stride = max(R, 1)  # keep a valid pointer when R == 0
        order32 = torch.full((rows, order_stride), -1, dtype=torch.int32, device=dev)
        order32[:, :R] = order.reshape(rows, R).to(torch.int32)
        tree = torch.zeros(rows, S + 1, dtype=torch.int32, device=dev)
        LOG = max(R, 0).bit_length()  # 2**LOG > R
        _running_topk_kernel[(rows,)](
            rank32, order32, tree, cutoff, boundary, keep,
            S, R, order_stride, sinks, window, k, LOG,
            num_warps=1,
        )
    return RunningTopK(
        rank=rank,
        cutoff=cutoff.reshape(shape),
        boundary=boundary.reshape(shape),
        keep_new=keep.bool().reshape(shape),
    )
