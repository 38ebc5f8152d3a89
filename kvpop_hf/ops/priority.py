"""The recency-decayed priority ``p_t = r_t - floor(t / n) * log_gamma_h`` (docs/design.md §1), in one place.

Only depends on torch, so every module (the cache layer included) can import it without a cycle.
"""

from __future__ import annotations

import torch

__all__ = ["decayed_priorities"]


def decayed_priorities(scores: torch.Tensor, positions: torch.Tensor, log_gamma: torch.Tensor | None,
                       decay_step: int) -> torch.Tensor:
    """``scores - floor(positions / decay_step) * log_gamma_h`` in float32.

    scores ``[b, h, S]``; positions integer, broadcastable to ``[b, h, S]`` (e.g. ``[S]`` or ``[b, h, S]``);
    log_gamma ``[h]`` (per KV head, usually < 0) or None for no decay -> ``[b, h, S]`` float32. Differentiable
    with respect to ``scores`` and ``log_gamma``."""
    if log_gamma is None:
        return scores.float()
    blocks = torch.div(positions, decay_step, rounding_mode="floor").float()
    return scores.float() - blocks * log_gamma.float().view(1, -1, 1)
