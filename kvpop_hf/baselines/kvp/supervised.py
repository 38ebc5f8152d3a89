"""Supervised ranking losses for the paper's ablation (KVP, ICML 2026, Sec. 9): same agent, same traces,
the future attention ``u_i`` of each context token as the label instead of a reward.

* ``"listnet"`` (listwise): ``L = -sum_i p_i log softmax(s)_i`` with ``p = u / sum(u)``;
* ``"pointwise"`` (regression): ``L = mean_i (s_i - log(eps + u_i / mean(u)))^2``.

scores, u ``[..., n]`` -> loss ``[...]`` (float32).
"""

from __future__ import annotations

import torch

LOSSES = ("listnet", "pointwise")


def supervised_loss(scores: torch.Tensor, u: torch.Tensor, kind: str = "listnet", eps: float = 1e-6) -> torch.Tensor:
    s, u = scores.float(), u.float()
    if kind == "listnet":
        p = u / u.sum(-1, keepdim=True).clamp_min(1e-12)
        return -(p * torch.log_softmax(s, -1)).sum(-1)
    if kind == "pointwise":
        target = torch.log(eps + u / u.mean(-1, keepdim=True).clamp_min(1e-12))
        return ((s - target) ** 2).mean(-1)
    raise ValueError(f"Unknown supervised loss {kind!r}; choose from {LOSSES}.")
