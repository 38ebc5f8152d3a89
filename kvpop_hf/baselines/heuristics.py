"""Training-free scorers: recency (StreamingLLM), key norm (K-Norm), seeded random, KeyDiff-free ones.

Each returns a static score per token, so the cache's exact top-k contract holds for them too.
"""

from __future__ import annotations

import torch

from ..scorers.base import Scorer


class StreamingScorer(Scorer):
    """Recency: ``r_t = t``. With k long-range slots this is StreamingLLM with a window of w + k
    (Xiao et al., 2023): the newest eligible tokens always win."""

    def score(self, layer_idx, keys, values, positions):
        return positions.float()


class KNormScorer(Scorer):
    """K-Norm (Devoto et al., 2024): keep keys with a *low* L2 norm, ``r_t = -||k_t||``."""

    def score(self, layer_idx, keys, values, positions):
        return -keys.float().norm(dim=-1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer mixing function (splitmix64 finaliser) in int64 arithmetic."""
    x = x ^ (x >> 30)
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as signed int64
    x = x ^ (x >> 27)
    x = x * -7723592293110705685  # 0x94d049bb133111eb as signed int64
    return x ^ (x >> 31)


class RandomScorer(Scorer):
    """Seeded random scores, a pure function of (seed, layer, head, position).

    Being a function of the position (not of call order) keeps whole-prompt, chunked and
    token-by-token runs identical, as the eviction contract requires.
    """

    head_offset = 0  # the model's index of this scorer's first KV head (a tensor-parallel rank's slice)

    def __init__(self, num_layers, num_kv_heads, head_dim, seed: int = 0):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.seed = int(seed)

    def config_dict(self):
        return {"seed": self.seed}

    def score(self, layer_idx, keys, values, positions):
        heads = torch.arange(positions.shape[1], device=positions.device).view(1, -1, 1) + self.head_offset
        key = positions.long() + (heads << 32) + (int(layer_idx) << 42) + (self.seed << 50)
        bits = _mix64(_mix64(key)) & ((1 << 24) - 1)
        return bits.float() / float(1 << 24)
