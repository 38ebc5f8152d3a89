"""The delayed-eviction rule of DMS, as a training bias and as a hard visibility rule.

DMS (Łańcucki et al., 2025; KVpop, arXiv:2607.05061, baselines) delays evictions by a sliding window: a token
``j`` marked for eviction stays visible while it is one of the last ``w`` tokens and is gone afterwards.
With ``s`` protected first tokens (sinks, as in every policy of this library; ``s = 0`` is the paper's rule),
query ``i`` sees key ``j <= i`` with

* training (relaxed decision ``alpha_j``): additive bias ``log(1 - alpha_j)`` if ``j >= s`` and ``i - j >= w``,
  else 0 (and ``-inf`` for ``j > i``);
* inference (hard decision ``e_j = alpha_j > 1/2``): visible iff ``j < s`` or ``i - j < w`` or not ``e_j``.

With ``alpha`` exactly 0 or 1 the bias is 0 or ``-inf`` exactly where the hard rule hides a key, so the two are
the same rule (checked by the tests).
"""

from __future__ import annotations

import torch

from ...config import check_int


def _check(sinks: int, window: int) -> None:
    check_int("sinks", sinks, 0)
    check_int("window", window, 1, "The delayed-eviction window holds at least the current token.")


def soft_eviction_bias(log_keep: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """log_keep ``[b, h, S]`` (``log(1 - alpha)`` per key) -> additive bias ``[b, h, S, S]`` (query, key)."""
    _check(sinks, window)
    if log_keep.dim() != 3:
        raise ValueError(f"log_keep must be [batch, kv_heads, tokens], got shape {tuple(log_keep.shape)}.")
    S = log_keep.shape[-1]
    i = torch.arange(S, device=log_keep.device)[:, None]
    j = torch.arange(S, device=log_keep.device)[None, :]
    delayed = (j >= sinks) & (i - j >= window)  # [S, S] where the decision applies
    bias = torch.where(delayed, log_keep[:, :, None, :], log_keep.new_zeros(()))
    return bias.masked_fill(j > i, float("-inf"))


def hard_visibility(query_pos: torch.Tensor, key_pos: torch.Tensor, evict: torch.Tensor, sinks: int,
                    window: int) -> torch.Tensor:
    """query_pos ``[b, L]`` (-1: padding), key_pos ``[b, h, C]`` (-1: none), evict ``[b, h, C]`` bool ->
    visible ``[b, h, L, C]``: ``0 <= p <= q`` and (``p < s`` or ``q - p < w`` or not evicted)."""
    _check(sinks, window)
    q = query_pos[:, None, :, None]
    p = key_pos[:, :, None, :]
    e = evict[:, :, None, :]
    return (q >= 0) & (p >= 0) & (p <= q) & ((p < sinks) | (q - p < window) | ~e)
