"""Gumbel-sigmoid relaxation of the DMS eviction decision (training only).

DMS (Łańcucki et al., 2025; described as a baseline in KVpop, arXiv:2607.05061) trains the binary decision
``evict_t`` with a Gumbel-sigmoid (binary Concrete) sample

    z_t = (logit_t + log u - log(1 - u)) / temperature,    u ~ U(0, 1),    alpha_t = sigmoid(z_t)

so ``P(alpha_t > 1/2) = sigmoid(logit_t)`` and ``alpha_t`` approaches a hard 0/1 sample as ``temperature -> 0``.
At inference the decision is hard: evict iff ``alpha_t > 1/2``, i.e. ``logit_t > 0`` (no noise).
The attention bias of a relaxed decision is ``log(1 - alpha_t) = logsigmoid(-z_t)``, finite for every ``z``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def relaxed_logits(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                   noise: bool = True) -> torch.Tensor:
    """``z = (logits + logistic noise) / temperature`` (same shape as ``logits``); ``noise=False`` drops the noise."""
    if not temperature > 0:
        raise ValueError(f"The Gumbel-sigmoid temperature temperature must be > 0, got {temperature!r}.")
    if not noise:
        return logits / temperature
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
    u = u.clamp(1e-6, 1 - 1e-6)
    return (logits + (torch.log(u) - torch.log1p(-u)).to(logits.dtype)) / temperature


def eviction_probability(z: torch.Tensor) -> torch.Tensor:
    """``alpha = sigmoid(z)``."""
    return torch.sigmoid(z)


def log_keep(z: torch.Tensor) -> torch.Tensor:
    """``log(1 - alpha) = logsigmoid(-z)``, the additive attention bias of a token evicted with weight alpha."""
    return F.logsigmoid(-z)
