"""Running top-k over a growing set of eligible KV tokens (plain torch reference).

KVpop (arXiv:2607.05061, section on efficient training) trains the eviction
scorer under the exact fixed-budget policy: at query ``q`` the cache keeps the
``s`` attention sinks, the ``w`` most recent tokens, and the ``k`` best of the
long-range tokens that have already left the window.  The paper computes that
"running top-k" for all queries at once with a Fenwick tree over priority
ranks (see ``fenwick_triton.py``); this module is the obviously-correct,
vectorised torch version used as the reference and as the CPU fallback.

Notation (per row = one batch element x one KV head):

* ``prio[t]``, ``t = 0..S-1``: static priority of token ``t`` (float).
* token ``t`` is *eligible* at query ``q`` iff ``s <= t <= q - w``; ``E(q)``.
* order "better": higher priority, ties broken in favour of the newer token.
* ``rank[t]``: 0-based position of ``t`` in that order among ``t >= s``;
  ``-1`` for sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import check_int

__all__ = [
    "RunningTopK",
    "priority_ranks",
    "running_topk_reference",
    "sparse_mask_reference",
]

# Upper bound on the number of elements of the dense [rows, queries, ranks]
# temporary built by the reference (int32 cumsum => 4 bytes each).
_MAX_DENSE_ELEMS = 1 << 24


@dataclass
class RunningTopK:
    """Result of the running top-k; all tensors have shape ``[..., S]``.

    Attributes:
        rank: int64, rank of each token among tokens ``t >= sinks`` (0 = best);
            ``-1`` for sinks.
        cutoff: int64, per query ``q``: rank of the k-th best eligible token;
            ``S`` if fewer than ``k`` tokens are eligible (all kept); ``-1``
            if ``k == 0``.  ``t`` is kept iff ``t in E(q)`` and
            ``rank[t] <= cutoff[q]``.
        boundary: int64, per query ``q``: token index of the weakest kept
            incumbent (k-th best of ``E(q-1)``) when a newcomer
            ``t_new = q - window >= sinks`` arrives, ``|E(q-1)| >= k >= 1``;
            else ``-1``.
        keep_new: bool, per query: the newcomer beats ``boundary[q]``
            (``False`` where ``boundary == -1``).
    """

    rank: torch.Tensor
    cutoff: torch.Tensor
    boundary: torch.Tensor
    keep_new: torch.Tensor


def _validate(prio, sinks, window=None, k=None):
    """Validate arguments; returns ``(sinks, window, k)`` as python ints."""
    if not isinstance(prio, torch.Tensor):
        raise ValueError(f"prio must be a torch.Tensor, got {type(prio).__name__}")
    if not prio.is_floating_point():
        raise ValueError(f"prio must be a floating-point tensor, got dtype {prio.dtype}")
    if prio.ndim < 1:
        raise ValueError("prio must have at least 1 dimension ([..., S]), got a scalar")
    sinks = check_int("sinks", sinks, 0)
    if window is not None:
        window = check_int("window", window, 1)
    if k is not None:
        k = check_int("k", k, 0)
    return sinks, window, k


def _ranks_and_order(prio: torch.Tensor, sinks: int):
    """Return ``(rank [..., S] int64, order [..., R] int64)`` with ``R = max(S - sinks, 0)``.

    ``order[r]`` is the token index holding rank ``r`` (inverse permutation).
    """
    S = prio.shape[-1]
    s = min(sinks, S)
    R = S - s
    cand = prio[..., s:]
    # Sort newest-first, then a *stable* sort by priority (descending) keeps
    # newer tokens ahead of older ones on ties.
    flipped = cand.flip(-1)
    idx = torch.sort(flipped, dim=-1, descending=True, stable=True).indices
    order = (S - 1) - idx  # token index of rank r
    rank = torch.full(prio.shape, -1, dtype=torch.int64, device=prio.device)
    ar = torch.arange(R, dtype=torch.int64, device=prio.device).expand_as(order)
    rank.scatter_(-1, order, ar)
    return rank, order


def priority_ranks(prio: torch.Tensor, sinks: int) -> torch.Tensor:
    """Ranks of tokens by priority.

    Args:
        prio: ``[..., S]`` float priorities.
        sinks: number of leading sink tokens (excluded from the ranking).

    Returns:
        ``[..., S]`` int64; ``0`` = best (highest priority, newer wins ties),
        ``-1`` for the first ``sinks`` tokens.  NaNs sort as the highest
        priority (torch.sort semantics).
    """
    sinks, _, _ = _validate(prio, sinks)
    return _ranks_and_order(prio, sinks)[0]


def _kth_eligible_rank(order: torch.Tensor, window: int, k: int, S: int) -> torch.Tensor:
    """For every ``q in -1..S-1``: rank of the k-th best token of ``E(q)``.

    Args:
        order: ``[rows, R]`` token index of each rank (all ``>= sinks``).

    Returns:
        ``[rows, S + 1]`` int64 (column ``j`` is query ``q = j - 1``); value
        ``R`` where ``|E(q)| < k``.
    """
    rows, R = order.shape
    out = torch.empty(rows, S + 1, dtype=torch.int64, device=order.device)
    if rows == 0:
        return out
    if R == 0 or k == 0:
        # nothing eligible ever (k-th does not exist) / k == 0 (unused).
        out.fill_(R if k > 0 else 0)
        return out
    # The token of rank r becomes eligible at query order[r] + window.
    elig_q = order + window  # [rows, R]
    queries = torch.arange(-1, S, dtype=torch.int64, device=order.device)
    per_q = max(1, _MAX_DENSE_ELEMS // max(R, 1))
    row_chunk = max(1, per_q // (S + 1))
    q_chunk = min(S + 1, per_q)
    for r0 in range(0, rows, row_chunk):
        e = elig_q[r0:r0 + row_chunk]
        for q0 in range(0, S + 1, q_chunk):
            qs = queries[q0:q0 + q_chunk]
            # eligible[i, j, r] = token of rank r is eligible at query qs[j]
            eligible = e[:, None, :] <= qs[None, :, None]
            cnt = eligible.to(torch.int32).cumsum(-1)
            # cnt is non-decreasing in r: #(cnt < k) = first r with cnt >= k.
            out[r0:r0 + row_chunk, q0:q0 + q_chunk] = (cnt < k).sum(-1)
    return out


def _assemble(rank, order, kth, sinks, window, k, S) -> RunningTopK:
    """Build a :class:`RunningTopK` from ``kth`` (see ``_kth_eligible_rank``).

    ``rank``: ``[rows, S]``, ``order``: ``[rows, R]``, ``kth``: ``[rows, S+1]``.
    """
    rows, R = order.shape
    dev = rank.device
    kth_now = kth[:, 1:]  # E(q)
    kth_prev = kth[:, :-1]  # E(q-1)
    if k == 0:
        cutoff = torch.full_like(kth_now, -1)
    else:
        cutoff = torch.where(kth_now < R, kth_now, torch.full_like(kth_now, S))
    q = torch.arange(S, dtype=torch.int64, device=dev)
    t_new = q - window
    has_new = (t_new >= sinks).expand(rows, S)
    valid = has_new & (kth_prev < R) & (k >= 1)
    order_pad = torch.cat([order, order.new_full((rows, 1), -1)], dim=-1)
    boundary = torch.gather(order_pad, 1, kth_prev.clamp(0, R))
    boundary = torch.where(valid, boundary, torch.full_like(boundary, -1))
    new_rank = torch.gather(rank, 1, t_new.clamp(min=0).expand(rows, S))
    keep_new = valid & (new_rank < kth_prev)
    return RunningTopK(rank=rank, cutoff=cutoff, boundary=boundary, keep_new=keep_new)


def running_topk_reference(prio: torch.Tensor, sinks: int, window: int, k: int) -> RunningTopK:
    """Running top-k, vectorised torch reference (O(S^2) work per row, chunked).

    Args:
        prio: ``[..., S]`` float priorities (any leading dims, e.g. ``[B, H, S]``).
        sinks: ``s >= 0`` always-kept leading tokens.
        window: ``w >= 1`` recent-window size (token ``t`` is in the window
            at query ``q`` iff ``q - t < w``).
        k: ``>= 0`` long-range budget.

    Returns:
        :class:`RunningTopK` with ``[..., S]`` tensors.
    """
    sinks, window, k = _validate(prio, sinks, window, k)
    return running_topk_from_kth(prio, sinks, window, k,
                                 lambda rank2, order2: _kth_eligible_rank(order2, window, k, rank2.shape[-1]))


def running_topk_from_kth(prio: torch.Tensor, sinks: int, window: int, k: int, kth_fn) -> RunningTopK:
    """The :class:`RunningTopK` of validated arguments, given ``kth_fn(rank [rows, S], order [rows, R])`` ->
    ``[rows, S + 1]`` (the contract of ``_kth_eligible_rank``): ranks, then the k-th eligible rank per query
    from the backend, then cutoff / boundary / keep_new. Shared by every backend."""
    shape = prio.shape
    S = shape[-1]
    rank, order = _ranks_and_order(prio.detach(), sinks)
    rank2 = rank.reshape(-1, S)
    order2 = order.reshape(rank2.shape[0], order.shape[-1])  # explicit R: reshape(0, -1) is ambiguous
    res = _assemble(rank2, order2, kth_fn(rank2, order2), sinks, window, k, S)
    return RunningTopK(
        rank=res.rank.reshape(shape),
        cutoff=res.cutoff.reshape(shape),
        boundary=res.boundary.reshape(shape),
        keep_new=res.keep_new.reshape(shape),
    )


def sparse_mask_reference(result: RunningTopK, sinks: int, window: int) -> torch.Tensor:
    """Dense attention mask implied by a running top-k (for tests / debugging).

    ``M[q, t] = t <= q and (t < s or q - t < w or (t in E(q) and rank[t] <= cutoff[q]))``.

    Args:
        result: output of a ``running_topk*`` call, tensors ``[..., S]``.

    Returns:
        ``[..., S, S]`` bool (query dim, then key dim).
    """
    sinks = check_int("sinks", sinks, 0)
    window = check_int("window", window, 1)
    rank, cutoff = result.rank, result.cutoff
    S = rank.shape[-1]
    dev = rank.device
    q = torch.arange(S, device=dev)[:, None]
    t = torch.arange(S, device=dev)[None, :]
    causal = t <= q
    sink = t < sinks
    recent = (q - t) < window
    eligible = (t >= sinks) & (t <= q - window)
    kept = eligible & (rank[..., None, :] <= cutoff[..., :, None])
    return causal & (sink | recent | kept)
