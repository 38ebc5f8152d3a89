"""Running top-k with a wavelet matrix, parallel over queries (plain torch).

KVpop (arXiv:2607.05061, section on efficient training: running top-k) needs,
for every query ``q`` of every row (batch x KV head), the rank of the k-th
best long-range token among ``E(q) = [sinks, q - window]``.  The Triton
Fenwick-tree backend (``fenwick_triton.py``) answers that with one sequential
sweep over the queries per row; this backend answers all queries at once.

Reformulation.  Let ``R = S - sinks`` and ``vals[i] = rank[sinks + i]``
(``i = 0..R-1``, position order; a permutation of ``0..R-1``).  ``E(q)`` is the
*prefix* ``vals[0:n(q)]`` with ``n(q) = clamp(q - window - sinks + 1, 0, R)``,
so the quantity wanted is the k-th smallest value of a prefix (``R`` if the
prefix holds fewer than ``k`` values).

Wavelet matrix.  Write every value with ``L = max(1, ceil(log2 R))`` bits,
most significant first.  Level 0 looks at the top bit of ``vals``; it stores
``Z[j]`` = number of zero bits among the first ``j`` entries (``[rows, R+1]``
int32) and ``nz = Z[R]``, then stably moves all entries with a 0 bit to the
front and those with a 1 bit behind them.  Level 1 does the same on the
reordered array with the next bit, and so on.  Because every partition is
stable, the entries that came from a contiguous range ``[l, r)`` with a given
bit land in a contiguous range of the next level: ``[Z[l], Z[r])`` for bit 0,
``[nz + l - Z[l], nz + r - Z[r])`` for bit 1.  The k-th smallest of
``[l, r)`` is then found top-down: if at least ``kk`` entries of the range
have a 0 at this bit, the answer has a 0 there and lives in the zero range;
otherwise it has a 1, ``kk`` drops by the zero count and the walk follows the
one range.  Each step is a couple of gathers, so all ``S + 1`` prefix queries
of all rows run as one batched walk of ``L`` steps: O(rows x S x log S) work,
no loop over queries or rows, O(rows x S x L) int32 memory for the levels.

Shapes: ``prio [..., S]`` float in, :class:`RunningTopK` of ``[..., S]``
tensors out, bit-identical to :func:`running_topk_reference` (the ranks and
the assembly of ``cutoff`` / ``boundary`` / ``keep_new`` are shared with it).
"""

from __future__ import annotations

import collections

import torch

from .reference import RunningTopK, _validate, running_topk_from_kth

__all__ = ["running_topk_wavelet"]


def _build_levels(vals: torch.Tensor, L: int):
    """Wavelet matrix of ``vals [rows, R]`` (int, values in ``[0, 2**L)``).

    Returns a list of ``L`` tuples ``(Z [rows, R+1] int32, nz [rows, 1] int64)``,
    most significant bit first.
    """
    rows, R = vals.shape
    dev = vals.device
    cur = vals.to(torch.int32)
    ar = torch.arange(R, dtype=torch.int32, device=dev)
    levels = []
    for lvl in range(L):
        shift = L - 1 - lvl
        bit = (cur >> shift) & 1
        Z = torch.zeros(rows, R + 1, dtype=torch.int32, device=dev)
        Z[:, 1:] = torch.cumsum(1 - bit, dim=1, dtype=torch.int32)
        nz = Z[:, R:]
        levels.append((Z, nz.long()))
        if lvl == L - 1:
            break
        excl = Z[:, :-1]  # zeros strictly before i
        dest = torch.where(bit == 0, excl, nz + ar - excl).long()
        cur = torch.empty_like(cur).scatter_(1, dest, cur)
    return levels


def _prefix_kth_smallest(vals: torch.Tensor, n: torch.Tensor, k: int) -> torch.Tensor:
    """k-th smallest (1-based ``k >= 1``) of every prefix ``vals[r, :n[j]]``.

    Args:
        vals: ``[rows, R]`` int, distinct or not, values in ``[0, R)``, ``R >= 1``.
        n: ``[Q]`` int64 prefix lengths in ``[0, R]`` (shared by all rows).

    Returns:
        ``[rows, Q]`` int64; ``R`` where ``n < k``.
    """
    rows, R = vals.shape
    L = max(1, (R - 1).bit_length())
    levels = _build_levels(vals, L)
    Q = n.shape[0]
    l = torch.zeros(rows, Q, dtype=torch.int64, device=vals.device)
    r = n.expand(rows, Q).contiguous()
    kk = torch.full((rows, Q), k, dtype=torch.int64, device=vals.device)
    ans = torch.zeros(rows, Q, dtype=torch.int64, device=vals.device)
    for lvl, (Z, nz) in enumerate(levels):
        zl_zr = torch.gather(Z, 1, torch.cat([l, r], dim=1)).long()
        zl, zr = zl_zr[:, :Q], zl_zr[:, Q:]
        z = zr - zl
        left = kk <= z
        kk = torch.where(left, kk, kk - z)
        ans = torch.where(left, ans, ans | (1 << (L - 1 - lvl)))
        l = torch.where(left, zl, nz + l - zl)
        r = torch.where(left, zr, nz + r - zr)
    return torch.where(n < k, torch.full_like(ans, R), ans)


def _kth_eligible_rank_wavelet(rank2: torch.Tensor, sinks: int, window: int, k: int) -> torch.Tensor:
    """Same contract as ``reference._kth_eligible_rank`` (``[rows, S + 1]`` int64).

    ``rank2``: ``[rows, S]`` int64 ranks (``-1`` for sinks).
    """
    rows, S = rank2.shape
    s = min(sinks, S)
    R = S - s
    dev = rank2.device
    out = torch.empty(rows, S + 1, dtype=torch.int64, device=dev)
    if rows == 0:
        return out
    if R == 0 or k == 0:
        out.fill_(R if k > 0 else 0)  # as the reference (k == 0: unused)
        return out
    q = torch.arange(-1, S, dtype=torch.int64, device=dev)
    n = (q - window - s + 1).clamp(0, R)
    if k > R:  # never k eligible tokens
        out.fill_(R)
        return out
    if USE_CUDA_GRAPHS and rank2.is_cuda and not torch.cuda.is_current_stream_capturing():
        return _prefix_kth_smallest_graphed(rank2[:, s:], n, k)
    return _prefix_kth_smallest(rank2[:, s:], n, k)


USE_CUDA_GRAPHS = True  # False: launch the walk's kernels one by one (benchmarks compare the two)
_GRAPHS: "collections.OrderedDict" = collections.OrderedDict()
_MAX_GRAPHS = 8


def _prefix_kth_smallest_graphed(vals: torch.Tensor, n: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_prefix_kth_smallest` replayed from a CUDA graph, one per (shape, k, device).

    The walk is a few hundred small kernels (about 25 per bit level) whose launches, not their work, set its
    time (milliseconds at any S); a training run calls it with one shape, so it is captured once and replayed
    (static input buffers copied in, the output copied out). At most ``_MAX_GRAPHS`` shapes are kept."""
    key = (tuple(vals.shape), vals.dtype, tuple(n.shape), int(k), vals.device)
    entry = _GRAPHS.get(key)
    if entry is None:
        static_vals, static_n = vals.clone(), n.clone()
        with torch.no_grad():
            side = torch.cuda.Stream(vals.device)
            side.wait_stream(torch.cuda.current_stream(vals.device))
            with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs advises
                _prefix_kth_smallest(static_vals, static_n, k)
            torch.cuda.current_stream(vals.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = _prefix_kth_smallest(static_vals, static_n, k)
        entry = (graph, static_vals, static_n, static_out)
        _GRAPHS[key] = entry
        while len(_GRAPHS) > _MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    else:
        _GRAPHS.move_to_end(key)
    graph, static_vals, static_n, static_out = entry
    static_vals.copy_(vals)
    static_n.copy_(n)
    graph.replay()
    return static_out.clone()


def running_topk_wavelet(prio: torch.Tensor, sinks: int, window: int, k: int) -> RunningTopK:
    """Running top-k via a wavelet matrix (all queries in parallel; any device).

    Args:
        prio: ``[..., S]`` float priorities (e.g. ``[B, H, S]``).
        sinks, window, k: as in :func:`running_topk_reference`.

    Returns:
        :class:`RunningTopK` with ``[..., S]`` tensors, identical to the
        reference.
    """
    sinks, window, k = _validate(prio, sinks, window, k)
    if prio.shape[-1] >= 2**31 - 1:
        raise ValueError(f"sequence length {prio.shape[-1]} too large for int32 counts")
    return running_topk_from_kth(prio, sinks, window, k,
                                 lambda rank2, order2: _kth_eligible_rank_wavelet(rank2, sinks, window, k))
