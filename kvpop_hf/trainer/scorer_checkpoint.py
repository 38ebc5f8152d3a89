"""Student priorities whose backward recomputes the scorer (gradient checkpointing of the scorer).

The scorer reads a layer's detached keys and values ``[b, h, S, d]`` and its activations are ``O(S)`` float32
tensors per layer (the mLSTM's sub-chunk blocks ``[b, h, S/T, T, T]``, the ``[k; v]`` input ``[b, h, S, 2d]``):
held for the boundary loss's backward in every layer they outgrow the backbone's own checkpointed activations
at long sequences. :func:`checkpointed_priorities` runs the scorer without autograd in the forward, keeps only
its inputs (the keys and values, which the layer holds anyway), and runs it again with autograd inside the
backward to get the gradients of the scorer's parameters (and of a learned decay). Same values and gradients
as calling the scorer directly (tests/test_scorer_checkpoint.py); autocast is replayed as it was.
"""

from __future__ import annotations

import torch


class _RecomputedPriorities(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, known, keys, values, *params):
        ctx.fn = fn
        ctx.params = params
        ctx.save_for_backward(keys, values)
        dev = keys.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        if known is not None:
            return known.clone()
        with torch.no_grad():
            return fn(keys, values)

    @staticmethod
    def backward(ctx, grad):
        keys, values = ctx.saved_tensors
        dev, enabled, dtype = ctx.autocast
        wanted = [p for p in ctx.params if p.requires_grad]
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
            prio = ctx.fn(keys, values)
        grads = iter(torch.autograd.grad(prio, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, None, None, *(next(grads) if p.requires_grad else None for p in ctx.params))


def checkpointed_priorities(fn, keys: torch.Tensor, values: torch.Tensor, params,
                            known: torch.Tensor | None = None) -> torch.Tensor:
    """``fn(keys, values)`` -> priorities ``[b, h, S]``, differentiable with respect to ``params`` (the tensors
    ``fn`` reads that may need a gradient: the scorer's parameters, a learned decay), recomputed in backward.
    ``keys`` and ``values`` must not require grad (the scorer's inputs are detached from the backbone).
    ``known``: the value of ``fn(keys, values)`` if already computed (a layer's recomputation under gradient
    checkpointing): returned (as a copy) without calling ``fn`` in the forward."""
    if keys.requires_grad or values.requires_grad:
        raise ValueError("checkpointed_priorities: keys and values must be detached from the backbone.")
    params = tuple(p for p in params if isinstance(p, torch.Tensor))
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
        return fn(keys, values) if known is None else known.clone()
    return _RecomputedPriorities.apply(fn, None if known is None else known.detach(), keys, values, *params)
