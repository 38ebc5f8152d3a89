"""LagKV scorer: its priorities equal the rule computed by brute force, and the cache built on it keeps
exactly the contract's entries (whole prompt, chunks, token by token, left padding)."""

import pytest
import torch

from helpers import distinct_ids, left_padded, reference_logits, reference_priorities, run_chunks, run_tokens, \
    run_whole, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.scorers import LagKVScorer


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


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cache_matches_reference_mask(arch):
    model = tiny_model(arch)
    ids = distinct_ids(2, 40, seed=13)
    kw = dict(sinks=2, window=5, topk=6, scorer="lagkv", scorer_kwargs={"lag": 5})
    probe = KVpopCache(model.config, **kw)
    ref, _ = reference_logits(model, ids, probe.scorer, 2, 5, 6)
    for feed in (run_whole, run_tokens, run_chunks):
        torch.testing.assert_close(feed(model, ids, KVpopCache(model.config, **kw)), ref, atol=2e-5, rtol=0)


def test_left_padded_batch_equals_rows_alone():
    model = tiny_model("qwen3")
    rows = [distinct_ids(1, n, seed=n)[0] for n in (25, 18)]
    ids, mask, width = left_padded(rows)
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    kw = dict(sinks=2, window=4, topk=6, scorer="lagkv", scorer_kwargs={"lag": 4})
    batch = model.generate(ids, attention_mask=mask, past_key_values=KVpopCache(model.config, **kw), **gen)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], attention_mask=torch.ones_like(r[None]),  # (id 0 is not padding here)
                               past_key_values=KVpopCache(model.config, **kw), **gen)
        assert torch.equal(batch[i, width:], alone[0, len(r):])
