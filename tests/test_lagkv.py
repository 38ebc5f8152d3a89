"""LagKV scorer: its priorities equal the rule computed by brute force. (The cache built on it is checked
against the contract with the other scorers: test_cache_contract.py, test_cache_generation.py.)"""

import pytest
import torch

from helpers import reference_priorities, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.baselines.lagkv import LagKVScorer

pytestmark = pytest.mark.tier("unit")


def spread(x, window):
    lo, hi = window.amin(-2), window.amax(-2)
    return ((x - lo) / (hi - lo + 1e-6)).std(-1, unbiased=False)


@pytest.mark.parametrize("lag", [1, 3, 4])
def test_priorities_follow_the_rule(lag):
    g = torch.Generator().manual_seed(lag)
    b, h, S, d, w = 2, 3, 15, 6, 4
    k, v = torch.randn(b, h, S, d, generator=g), torch.randn(b, h, S, d, generator=g)
    prio = reference_priorities(LagKVScorer(1, h, d, lag=lag), 0, k, v, w)
    for u in range(S):
        q = u + w  # u is read after token q is absorbed, against the last `lag` tokens up to q
        if q >= S:
            assert torch.isinf(prio[:, :, u]).all()
            continue
        lo = max(0, q - lag + 1)
        expect = spread(k[:, :, u], k[:, :, lo:q + 1]) + spread(v[:, :, u], v[:, :, lo:q + 1])
        torch.testing.assert_close(prio[:, :, u], expect, atol=1e-4, rtol=1e-4)


def test_bad_lag():
    with pytest.raises(ValueError, match="lag"):
        KVpopCache(tiny_model("qwen3").config, scorer="lagkv", scorer_kwargs={"lag": 0})
