"""Plackett-Luce ranking policy, sampled by Gumbel-sort, with RLOO advantages (KVP, ICML 2026, Sec. 4 and 6).

A permutation ``sigma`` (``sigma[0]`` = most worth keeping) of ``n`` items with scores ``s`` has

    log pi(sigma | s) = sum_{i=1}^{n} [ s_{sigma_i} - log sum_{j>=i} exp(s_{sigma_j}) ]

and ``argsort(s + g, descending)`` with ``g_i ~ Gumbel(0, 1)`` i.i.d. is an exact sample of it.
RLOO over ``K`` samples of one problem: ``b_k = (sum_l R_l - R_k) / (K - 1)``, ``A_k = R_k - b_k``.
"""

from __future__ import annotations

import torch


def gumbel_sort(scores: torch.Tensor, num_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """scores ``[..., n]`` -> ``num_samples`` Plackett-Luce permutations ``[num_samples, ..., n]`` (int64)."""
    u = torch.rand((num_samples, *scores.shape), generator=generator, device=scores.device)
    g = -torch.log(-torch.log(u.clamp(1e-10, 1.0 - 1e-7)))
    return torch.argsort(scores.detach().float()[None] + g, dim=-1, descending=True)


def pl_log_prob(scores: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Plackett-Luce log-probability of ``perm [..., n]`` under ``scores`` (broadcast to ``perm``) -> ``[...]``.

    Differentiable in ``scores``; float32."""
    s = torch.gather(scores.float().expand(perm.shape), -1, perm)  # s_{sigma_i}
    tail = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)  # log sum_{j >= i} exp(s_{sigma_j})
    return (s - tail).sum(-1)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards ``[K, ...]`` (``K >= 2`` samples of the same problem) -> ``R_k - mean_{l != k} R_l``, same shape."""
    K = rewards.shape[0]
    if K < 2:
        raise ValueError(f"RLOO needs at least 2 samples per problem, got {K}.")
    baseline = (rewards.sum(0, keepdim=True) - rewards) / (K - 1)
    return rewards - baseline
