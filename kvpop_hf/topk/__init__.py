"""Running top-k of KV tokens by priority (KVpop, arXiv:2607.05061).

At query ``q`` the fixed-budget cache keeps ``sinks`` leading tokens, the
``window`` most recent ones, and the ``k`` highest-priority tokens among those
that left the window (ties: newer wins).  KVpop's efficient training computes
this for all queries with a Fenwick tree over priority ranks.

Backends: :func:`running_topk_reference` (vectorised torch) and
:func:`running_topk_triton` (Triton Fenwick-tree kernel; imported lazily so
``import kvpop_hf.topk`` never imports triton).
"""

from __future__ import annotations


import torch

from .reference import (
    RunningTopK,
    _validate,
    priority_ranks,
    running_topk_reference,
    sparse_mask_reference,
)

__all__ = [
    "RunningTopK",
    "priority_ranks",
    "running_topk",
    "running_topk_reference",
    "running_topk_triton",
    "sparse_mask_reference",
]

_BACKENDS = ("auto", "torch", "reference", "triton")


def running_topk_triton(prio: torch.Tensor, sinks: int, window: int, k: int) -> RunningTopK:
    """Triton Fenwick-tree backend; see :mod:`kvpop_hf.topk.fenwick_triton`.

    ``prio``: ``[..., S]`` float; returns :class:`RunningTopK` of ``[..., S]``.
    """
    from .fenwick_triton import running_topk_triton as _impl

    return _impl(prio, sinks, window, k)


def running_topk(
    prio: torch.Tensor, sinks: int, window: int, k: int, backend: str = "auto"
) -> RunningTopK:
    """Running top-k for every query position.

    Args:
        prio: ``[..., S]`` float priorities (e.g. ``[B, H, S]``).
        sinks: ``>= 0``; window: ``>= 1``; k: ``>= 0``.
        backend: ``"auto"`` (Triton if ``prio.is_cuda``, else torch; the
            CPU interpreter is for tests only), ``"torch"``/``"reference"``,
            or ``"triton"``.

    Returns:
        :class:`RunningTopK` with ``[..., S]`` tensors.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    _validate(prio, sinks, window, k)
    if backend == "auto":
        backend = "triton" if prio.is_cuda else "torch"
    if backend == "triton":
        return running_topk_triton(prio, sinks, window, k)
    return running_topk_reference(prio, sinks, window, k)
