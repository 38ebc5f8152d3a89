"""LagKV (Liang et al., 2025) as a static priority: a token's keys and values measured against the tokens
that follow it.

LagKV splits the sequence into partitions of ``lag`` tokens and scores each token by how much its key and
value stand out once min-max normalised with the statistics of the *next* partition: the spread (standard
deviation over channels) of the normalised vector, keys and values added. Here the "next partition" of
token ``u`` is the ``lag`` tokens absorbed last when ``u`` is read, which happens as ``u`` leaves the window
(docs/design.md §1), so with ``lag = window`` they are exactly the tokens ``u+1 .. u+w`` (``lag`` must not
exceed the window for that):

    x~ = (x_u - min_lag(x)) / (max_lag(x) - min_lag(x) + eps),   r_u = std_c(k~_u) + std_c(v~_u)

(minimum and maximum per channel). The per-partition softmax of the original only rescales scores inside a
partition and is left out, so that priorities compare across the whole sequence. State per (row, KV head):
the last ``lag`` keys and values and which of them are real tokens (padding is skipped).
"""

from __future__ import annotations

import torch

from ..scorers.base import Scorer, check_scorer_option

EPS = 1e-6


def _lag_stats(x: torch.Tensor, real: torch.Tensor, lag: int):
    """Per-channel min and max over the last ``lag`` real entries ending at each position.

    x ``[b, h, lag - 1 + n, d]`` (the ring's last ``lag - 1`` entries, then ``n`` new ones), real
    ``[b, h, lag - 1 + n]`` -> (min, max) ``[b, h, n, d]``."""
    inf = torch.finfo(x.dtype).max
    lo = torch.where(real[..., None], x, inf).unfold(2, lag, 1)  # [b,h,n,d,lag] (a view)
    hi = torch.where(real[..., None], x, -inf).unfold(2, lag, 1)
    return lo.amin(-1), hi.amax(-1)


def _spread(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return ((x - lo) / (hi - lo + EPS)).std(-1, unbiased=False)


class LagKVScorer(Scorer):
    """Attention-free, training-free; stateful (the last ``lag`` keys/values), read when a token leaves
    the window."""

    stateful = True
    delayed = True

    def __init__(self, num_layers, num_kv_heads, head_dim, lag: int = 128):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.lag = check_scorer_option("lagkv", "lag", lag, 1)

    def config_dict(self):
        return {"lag": self.lag}

    def init_state(self, layer_idx, batch_size, device):
        b, h, L, d = batch_size, self.num_kv_heads, self.lag, self.head_dim
        return (torch.zeros(b, h, L, d, device=device), torch.zeros(b, h, L, d, device=device),
                torch.zeros(b, h, L, device=device))  # keys, values, 1.0 where a real token

    def absorb_and_read(self, layer_idx, state, new_keys, new_values, new_valid, read_keys, read_values):
        ring_k, ring_v, ring_real = state
        b, h, n, _ = new_keys.shape
        real_new = torch.ones(b, h, n, device=new_keys.device) if new_valid is None else \
            new_valid[:, None, :].expand(b, h, n).float()
        keep = self.lag - 1
        k = torch.cat([ring_k[:, :, self.lag - keep:], new_keys.float()], 2)
        v = torch.cat([ring_v[:, :, self.lag - keep:], new_values.float()], 2)
        real = torch.cat([ring_real[:, :, self.lag - keep:], real_new], 2) > 0
        k_lo, k_hi = _lag_stats(k, real, self.lag)
        v_lo, v_hi = _lag_stats(v, real, self.lag)
        scores = _spread(read_keys.float(), k_lo, k_hi) + _spread(read_values.float(), v_lo, v_hi)
        # the new ring: the last `lag` entries (padding included, marked as not real)
        all_k = torch.cat([ring_k, new_keys.float()], 2)[:, :, -self.lag:]
        all_v = torch.cat([ring_v, new_values.float()], 2)[:, :, -self.lag:]
        all_real = torch.cat([ring_real, real_new], 2)[:, :, -self.lag:]
        return (all_k.contiguous(), all_v.contiguous(), all_real.contiguous()), scores
