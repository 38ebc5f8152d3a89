"""The DMS compression objective: a target eviction rate, its ramp-up schedule and the one-sided penalty.

DMS (Łańcucki et al., 2025; baseline of KVpop, arXiv:2607.05061) distils the model from its dense self while
a penalty pushes the mean eviction decision up to a target that grows during training (the compression-ratio
schedule), so the model has time to adapt to each level:

    L = L_distill + lambda * max(0, rate(step) - mean_{l, h, b, t >= s} alpha[l, h, b, t])

One-sided: only a shortfall is penalised, the distillation pulls the other way, and how the evictions are
spread over layers and heads is free, which makes DMS's memory per head ragged. Nothing stops the rate from
passing the target, though (a penalty that is met no longer pulls); the ``two_sided`` variant
``|rate(step) - mean alpha|`` holds it there, for comparisons at matched average memory.

Budget matching (this library's budgets, ``B = s + w + k`` per layer and KV head at sequence length ``L``):
a head that evicts a fraction ``r`` of its tokens ``t >= s`` keeps, after ``L`` tokens, the ``s`` sinks, the
``w`` tokens of the window and ``(1 - r)(L - s - w)`` older ones, so its *average* memory is ``B`` when
``r = 1 - k / (L - s - w)`` (:func:`target_eviction_rate`).
"""

from __future__ import annotations

import math

import torch

from ...config import check_int


def target_eviction_rate(budget: int, length: int, sinks: int, window: int) -> float:
    """The eviction rate over tokens ``t >= s`` at which the mean memory per head after ``length`` tokens is
    ``budget`` entries: ``1 - (budget - s - w) / (length - s - w)``."""
    for name, value, lo in (("budget", budget, 1), ("length", length, 1), ("sinks", sinks, 0), ("window", window, 1)):
        check_int(name, value, lo)
    if not sinks + window <= budget <= length:
        raise ValueError(f"budget {budget} must lie between sinks + window = {sinks + window} and the length {length}.")
    if length == sinks + window:
        return 0.0
    return 1.0 - (budget - sinks - window) / (length - sinks - window)


class CompressionSchedule:
    """``rate(step) = final_rate * min(1, step / ramp_steps)`` (linear ramp, then constant)."""

    def __init__(self, final_rate: float, ramp_steps: int):
        if not (0.0 <= final_rate < 1.0) or math.isnan(final_rate):
            raise ValueError(f"The final eviction rate must be in [0, 1), got {final_rate!r}.")
        self.final_rate = float(final_rate)
        self.ramp_steps = check_int("ramp_steps", ramp_steps, 0)

    def rate(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        if self.ramp_steps == 0:
            return self.final_rate
        return self.final_rate * min(1.0, step / self.ramp_steps)


def mean_eviction(alphas: list[torch.Tensor] | tuple[torch.Tensor, ...], sinks: int) -> torch.Tensor:
    """Mean of the relaxed decisions over layers, rows, heads and tokens ``t >= s``; each ``[b, h, S]``."""
    if not alphas:
        raise ValueError("No eviction decisions were recorded: did the model run the 'dms_train' attention?")
    parts = [a[..., sinks:] for a in alphas]
    n = sum(p.numel() for p in parts)
    if n == 0:
        raise ValueError(f"The sequences have no token after the {sinks} sinks: nothing to evict.")
    return sum(p.float().sum() for p in parts) / n


def compression_loss(mean_alpha: torch.Tensor, rate: float, two_sided: bool = False) -> torch.Tensor:
    """``max(0, rate - mean_alpha)``: the one-sided penalty on a shortfall of evictions (DMS); ``two_sided``:
    ``|rate - mean_alpha|``, which also pulls an overshoot back, so the average memory lands on the budget."""
    return (rate - mean_alpha).abs() if two_sided else torch.clamp(rate - mean_alpha, min=0.0)
