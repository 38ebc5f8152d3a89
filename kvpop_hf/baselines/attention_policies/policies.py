"""Attention-based policies whose scores change every step: TOVA, H2O and SnapKV (docs/design.md §7).

They are not scorers of single tokens: the score of a stored entry comes from the attention the
``kvpop`` attention function computes (:mod:`kvpop_hf.baselines.attention_policies.scores`), so a cache with one of them
uses :class:`kvpop_hf.baselines.attention_policies.layer.DynamicScoreLayer` instead of the static-priority layer. These
classes only hold the options and the per-policy arithmetic; shapes: ``w`` query weights ``[b, L]``,
candidate scores ``[b, h, C]`` float32 (a group's attention probabilities, averaged over its ``G``
query heads, summed over the weighted queries).

* TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): the score of an entry is the
  attention of the latest query; the lowest is evicted.
* H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle"): the score is the attention accumulated over
  every query that saw the entry ("heavy hitters"); the recent window is protected.
* SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): a prompt
  chunk's last ``obs_window`` queries vote, the votes are pooled over neighbouring positions
  (``kernel_size``, max or avg), and the selection is then fixed while decoding.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ...scorers.base import Scorer, check_scorer_option
from .layer import DynamicScoreLayer

NEG_INF = float("-inf")


class AttentionPolicy(Scorer):
    """Base of the dynamic-score policies: their scores change every step, so KVpopCache stores their entries in
    :class:`~.layer.DynamicScoreLayer`."""

    dynamic = True
    layer_class = DynamicScoreLayer
    decode_scores = True  # whether a decode step's attention probabilities are needed

    def score(self, layer_idx, keys, values, positions):
        raise TypeError(f"{type(self).__name__} scores entries from attention, not from keys and values alone; "
                        "it is used through KVpopCache's dynamic layer.")

    def query_weights(self, valid: torch.Tensor) -> torch.Tensor:
        """Which queries of a chunk vote: valid ``[b, L]`` bool -> weights ``[b, L]`` float32."""
        raise NotImplementedError

    def chunk_scores(self, old: torch.Tensor, votes: torch.Tensor, cand_pos: torch.Tensor,
                     n_old: int) -> torch.Tensor:
        """Scores ``[b, h, C]`` of the candidates at a chunk's end from the stored scores ``old [b, h, n_old]``
        and the votes ``[b, h, C]`` of the chunk's weighted queries; cand_pos ``[b, h, C]`` (-1: none)."""
        raise NotImplementedError

    def decode_update(self, prio: torch.Tensor, probs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Scores ``[b, h, B]`` after a decode step from the stored ones and that query's probabilities;
        pos ``[b, h, B]`` the slots' positions (-1: empty)."""
        raise NotImplementedError

    # score of a new decode token until its own attention is recorded (TOVA/H2O overwrite/add to it)
    new_token_score = 0.0


def _last_real(valid: torch.Tensor) -> torch.Tensor:
    """One-hot ``[b, L]`` float of each row's last real query (all zero for a row without one)."""
    idx = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, idx, -1).amax(-1, keepdim=True)
    return (idx == last).float() * valid.float()


class TOVAPolicy(AttentionPolicy):
    """TOVA: score = attention probability of the latest query. ``heads="layer"`` (default, the paper's rule):
    averaged over every query head of the layer, so all KV heads of a layer keep the same positions;
    ``heads="kv_head"``: averaged over each KV head's own query heads, each KV head deciding alone."""

    HEADS = ("layer", "kv_head")

    def __init__(self, num_layers, num_kv_heads, head_dim, heads: str = "layer"):
        super().__init__(num_layers, num_kv_heads, head_dim)
        if heads not in self.HEADS:
            raise ValueError(f"Scorer 'tova': `heads` must be 'layer' (the latest query's attention averaged over "
                             f"the layer's heads, as in the TOVA paper) or 'kv_head' (each KV head on its own), got "
                             f"{heads!r}. Fix scorer_kwargs={{'heads': ...}}.")
        self.heads = heads

    def config_dict(self):
        return {"heads": self.heads}

    def query_weights(self, valid):
        return _last_real(valid)

    def _shared(self, votes, pos):
        return votes if self.heads == "kv_head" else mean_over_heads_by_position(votes, pos)

    def chunk_scores(self, old, votes, cand_pos, n_old):
        return self._shared(votes, cand_pos)

    def decode_update(self, prio, probs, pos):
        return self._shared(probs, pos)


class H2OPolicy(AttentionPolicy):
    """H2O: score = attention accumulated over all queries that saw the entry (new entries start at 0)."""

    def query_weights(self, valid):
        return valid.float()

    def chunk_scores(self, old, votes, cand_pos, n_old):
        acc = torch.cat([old, old.new_zeros(*old.shape[:2], votes.shape[-1] - n_old)], dim=-1)
        return acc + votes

    def decode_update(self, prio, probs, pos):
        return prio + probs


class SnapKVPolicy(AttentionPolicy):
    """SnapKV: votes of a chunk's last ``obs_window`` real queries, pooled over ``kernel_size`` neighbouring
    candidates in position order (``pooling`` "max" or "avg", zero / -inf padded as ``F.max_pool1d`` /
    ``F.avg_pool1d``); decoding records no votes and new tokens score -inf."""

    decode_scores = False
    new_token_score = NEG_INF

    def __init__(self, num_layers, num_kv_heads, head_dim, obs_window: int = 32, kernel_size: int = 5,
                 pooling: str = "avg"):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.obs_window = check_scorer_option("snapkv", "obs_window", obs_window, 1)
        self.kernel_size = check_scorer_option("snapkv", "kernel_size", kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"Scorer 'snapkv': `kernel_size` must be odd (the pooled window is centred on each "
                             f"entry), got {kernel_size}. Fix scorer_kwargs={{'kernel_size': ...}}.")
        if pooling not in ("max", "avg"):
            raise ValueError(f"Scorer 'snapkv': `pooling` must be 'max' or 'avg', got {pooling!r}. "
                             "Fix scorer_kwargs={'pooling': ...}.")
        self.pooling = pooling

    def config_dict(self):
        return {"obs_window": self.obs_window, "kernel_size": self.kernel_size, "pooling": self.pooling}

    def query_weights(self, valid):
        from_end = valid.long().flip(-1).cumsum(-1).flip(-1)  # real queries at or after j
        return (valid & (from_end <= self.obs_window)).float()

    def chunk_scores(self, old, votes, cand_pos, n_old):
        return pool_by_position(votes, cand_pos, self.kernel_size, self.pooling)

    def decode_update(self, prio, probs, pos):
        return prio


def mean_over_heads_by_position(values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``values [b, h, C]`` of the entries at positions ``pos [b, h, C]`` (-1: none) -> for each entry the mean of
    the values every KV head of its row holds for that position (the layer-wide score of TOVA; the group means are
    over equal numbers of query heads, so this is the mean over all query heads). Entries without a position: 0."""
    b, v32 = values.shape[0], values.float().reshape(values.shape[0], -1)  # sums in float32 whatever the dtype
    flat = pos.reshape(b, -1)  # [b, N]: entries of every KV head, N = h * C
    sorted_pos, order = flat.sort(dim=-1)
    starts = torch.ones_like(sorted_pos, dtype=torch.bool)
    starts[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
    group = torch.empty_like(order).scatter_(1, order, starts.long().cumsum(-1) - 1)  # equal positions, one group
    total = v32.new_zeros(flat.shape).scatter_add_(1, group, v32)  # at most N groups: no host sync on the size
    count = v32.new_zeros(flat.shape).scatter_add_(1, group, torch.ones_like(v32))
    mean = (total / count.clamp(min=1)).gather(1, group).reshape(values.shape)
    return torch.where(pos >= 0, mean, 0.0).to(values.dtype)


def pool_by_position(votes: torch.Tensor, cand_pos: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Pool ``votes [b, h, C]`` over ``kernel`` neighbouring real candidates in position order (candidates with
    position -1 are left out) and return the pooled values in candidate order (-inf for none)."""
    b, h, C = votes.shape
    key = torch.where(cand_pos >= 0, cand_pos, torch.iinfo(torch.long).max)
    order = key.argsort(dim=-1, stable=True)  # real candidates first, by position
    n_real = (cand_pos >= 0).sum(-1, keepdim=True)  # [b, h, 1]
    real_sorted = torch.arange(C, device=votes.device) < n_real
    pad = NEG_INF if pooling == "max" else 0.0
    x = torch.where(real_sorted, votes.gather(-1, order), pad).reshape(b * h, 1, C)
    if pooling == "max":
        pooled = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)  # zero padding counted, as avg_pool1d
    pooled = torch.where(real_sorted, pooled.reshape(b, h, C), NEG_INF)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)
