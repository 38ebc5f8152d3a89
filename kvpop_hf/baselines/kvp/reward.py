"""Holistic reward of a ranking: normalised rank-weighted future-attention AUC (KVP, ICML 2026, Sec. 5).

A trace of one (layer, KV head) holds queries ``q [G, S, D]`` (the ``G`` query heads of the KV head) and keys
``k [S, D]``. With context length ``n`` (tokens ``0..n-1`` cached) the future tokens ``j = n..S-1`` attend with
the model's causal softmax; GQA takes the largest weight over the group:

    A(i, j) = max_g softmax_{t <= j}(scale * q_{g,j} . k_t)[i],     u_i = sum_{j=n}^{S-1} A(i, j)

``u_i`` is token ``i``'s future attention. Evicting all but the first ``b`` tokens of ``sigma`` costs
``C_b = sum_{i > b} u_{sigma_i}``; the area under the cost-budget curve is rank-weighted:

    C(sigma) = sum_{b=0}^{n-1} C_b = sum_{r=1}^{n} r * u_{sigma_r}

``C(sigma*)`` of the oracle order (``u`` descending) is the smallest; the reward is
``R(sigma) = -C(sigma) / C(sigma*) <= -1`` and the normalised AUC cost ``C(sigma) / C(sigma*) >= 1``.
"""

from __future__ import annotations

import torch

#: guards the normalisation when a context receives no future attention at all
EPS = 1e-12


def future_attention(q: torch.Tensor, k: torch.Tensor, n: int, scale: float, chunk: int = 256) -> torch.Tensor:
    """q ``[Hq, S, D]``, k ``[Hkv, S, D]`` (``Hq = G * Hkv``), context length ``n`` -> ``u [Hkv, n]`` float32:
    the attention context token ``i`` receives from queries ``n..S-1``, max over the query heads of its KV head."""
    Hq, S, _ = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    q, k = q.float(), k.float()
    u = q.new_zeros(Hkv, n)
    t = torch.arange(S, device=q.device)
    for j0 in range(n, S, chunk):
        j = torch.arange(j0, min(S, j0 + chunk), device=q.device)
        logits = scale * torch.einsum("hgjd,htd->hgjt", q[:, j].view(Hkv, G, len(j), -1), k)  # [Hkv, G, c, S]
        logits = logits.masked_fill(t[None, None, None, :] > j[None, None, :, None], float("-inf"))
        probs = logits.softmax(-1)[..., :n]  # [Hkv, G, c, n]
        u += probs.amax(1).sum(1)
    return u


def auc_cost(u: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rank-weighted AUC ``C(sigma) = sum_r r * u[sigma_r]``: u ``[..., n]`` (broadcast), perm ``[..., n]``
    -> ``[...]``."""
    n = perm.shape[-1]
    ranks = torch.arange(1, n + 1, device=perm.device, dtype=torch.float32)
    return (torch.gather(u.float().expand(perm.shape), -1, perm) * ranks).sum(-1)


def oracle_auc_cost(u: torch.Tensor) -> torch.Tensor:
    """``C(sigma*)``, the cost of ``u`` sorted descending: u ``[..., n]`` -> ``[...]``."""
    return auc_cost(u, torch.argsort(u, dim=-1, descending=True))


def normalized_auc_cost(u: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``C(sigma) / C(sigma*) >= 1`` (1 for the oracle order): u ``[..., n]``, perm ``[..., n]`` -> ``[...]``."""
    return auc_cost(u, perm) / oracle_auc_cost(u).clamp_min(EPS)


def reward(u: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``R(sigma) = -C(sigma) / C(sigma*) <= -1``, shapes as :func:`normalized_auc_cost`."""
    return -normalized_auc_cost(u, perm)
