"""Running top-k of KV tokens by priority (KVpop, arXiv:2607.05061).

At query ``q`` the fixed-budget cache keeps ``sinks`` leading tokens, the
``window`` most recent ones, and the ``k`` highest-priority tokens among those
that left the window (ties: newer wins).  KVpop's efficient training computes
this for all queries with a Fenwick tree over priority ranks.

Backends: :func:`running_topk_reference` (vectorised torch, O(S^2) work per
row; the CPU default), :func:`running_topk_wavelet` (wavelet matrix in plain
torch, all queries in parallel, O(S log S) work per row; the CUDA default) and
:func:`running_topk_triton` (Triton Fenwick-tree kernel, one sequential sweep
over the queries per row; imported lazily so ``import kvpop_hf.ops.running_topk`` never
imports triton).  All three return identical results.
"""

from __future__ import annotations


import torch

from ...backends import resolve_choice
from .reference import (
    RunningTopK,
    _validate,
    priority_ranks,
    running_topk_reference,
    sparse_mask_reference,
)
from .wavelet import running_topk_wavelet

__all__ = [
    "RunningTopK",
    "priority_ranks",
    "running_topk",
    "running_topk_reference",
    "running_topk_triton",
    "running_topk_wavelet",
    "sparse_mask_reference",
]


def running_topk_triton(prio: torch.Tensor, sinks: int, window: int, k: int) -> RunningTopK:
    """Triton Fenwick-tree backend; see :mod:`kvpop_hf.ops.running_topk.fenwick_triton`.

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
        backend: ``Backends.running_topk`` (kvpop_hf/backends.py): ``"torch"`` (vectorised O(S^2) reference),
            ``"wavelet"`` (wavelet matrix, parallel over queries, any device) or ``"triton"`` (Fenwick-tree
            kernel, one sequential program per row; on CPU only through the Triton interpreter, for tests);
            ``"auto"``: the device's default (``"wavelet"`` on CUDA, else ``"torch"``).

    Returns:
        :class:`RunningTopK` with ``[..., S]`` tensors.
    """
    _validate(prio, sinks, window, k)
    backend = resolve_choice("running_topk", backend, prio.device)
    if backend == "wavelet":
        return running_topk_wavelet(prio, sinks, window, k)
    if backend == "triton":
        return running_topk_triton(prio, sinks, window, k)
    return running_topk_reference(prio, sinks, window, k)
