"""The eviction contract (docs/design.md §1): KVpopCache == an independent per-head reference mask."""

import pytest
import torch
from transformers import DynamicCache

from helpers import distinct_ids, reference_logits, run_chunks, run_tokens, run_whole, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

ARCHS = ["qwen3", "llama", "qwen2", "mistral"]
S, W, K = 2, 5, 6


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["kvpop", "sdpa"])
def test_large_budget_equals_dynamic_cache(arch, attn):
    model = tiny_model(arch, attn=attn)
    ids = distinct_ids(2, 30)
    dense = run_whole(model, ids, DynamicCache(config=model.config))
    # a stock attention needs per-row position ids to feed chunks of several rows (the cache cannot see padding)
    chunks = run_chunks if attn == "kvpop" else _run_chunks_with_positions
    for feed in (run_whole, run_tokens, chunks):
        cache = KVpopCache(model.config, sinks=2, window=4, topk=24, scorer="knorm")  # B = 30
        torch.testing.assert_close(feed(model, ids, cache), dense, atol=2e-5, rtol=0)
    gen_kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **with_cache(model, DynamicCache(config=model.config)), **gen_kw)
    out = model.generate(ids, **with_cache(model, KVpopCache(model.config, sinks=2, window=4, topk=40)), **gen_kw)
    assert torch.equal(out, ref)


def _run_chunks_with_positions(model, ids, cache, sizes=(3, 1, 7, 2, 9, 1, 5, 13)):
    """``run_chunks`` with position ids of one row per batch row (as generate passes them)."""
    out, i = [], 0
    with torch.no_grad():
        for n in sizes * 10:
            if i >= ids.shape[1]:
                break
            chunk = ids[:, i:i + n]
            pos = torch.arange(i, i + chunk.shape[1]).expand(ids.shape[0], -1)
            out.append(model(chunk, position_ids=pos, **with_cache(model, cache)).logits)
            i += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("scorer", ["knorm", "keydiff", "lagkv", "mlp", "mlstm", "kvp"])
@pytest.mark.parametrize("decay", [None, -0.7])
def test_matches_reference_mask(arch, scorer, decay):
    model = tiny_model(arch)
    ids = distinct_ids(2, 44, seed=1)
    make = lambda: KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=scorer, log_gamma=decay, decay_step=4)
    probe = make()
    ref, _ = reference_logits(model, ids, probe.scorer, S, W, K, probe.log_gamma, 4)
    for feed in (run_whole, run_tokens, run_chunks):
        torch.testing.assert_close(feed(model, ids, make()), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("scorer", ["streaming", "random"])
def test_heuristics_match_reference(scorer):
    model = tiny_model("qwen2")
    ids = distinct_ids(1, 40, seed=2)
    probe = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=scorer)
    ref, _ = reference_logits(model, ids, probe.scorer, S, W, K)
    torch.testing.assert_close(run_tokens(model, ids, KVpopCache(model.config, sinks=S, window=W, topk=K,
                                                                  scorer=scorer)), ref, atol=2e-5, rtol=0)


def test_immediate_mlstm_matches_reference():
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 40, seed=3)
    kw = dict(sinks=S, window=W, topk=K, scorer="mlstm", scorer_kwargs={"delayed": False})
    probe = KVpopCache(model.config, **kw)
    ref, _ = reference_logits(model, ids, probe.scorer, S, W, K)
    for feed in (run_whole, run_tokens, run_chunks):
        torch.testing.assert_close(feed(model, ids, KVpopCache(model.config, **kw)), ref, atol=2e-5, rtol=0)


def test_stored_set_is_reference_topk():
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 50, seed=4)
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="mlp")
    _, masks = reference_logits(model, ids, cache.scorer, S, W, K)
    run_chunks(model, ids, cache)
    for li, mask in masks.items():
        stored = cache.stored_positions(li)[0]  # [h, B]
        for h in range(stored.shape[0]):
            expect = set(torch.nonzero(mask[0, h, -1]).flatten().tolist())
            assert set(stored[h].tolist()) == expect


def test_stock_attention_warns_for_chunks_and_decode_is_exact():
    model = tiny_model("qwen3", attn="sdpa")
    ids = distinct_ids(1, 30, seed=5)
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="knorm")
    ref, _ = reference_logits(model, ids, cache.scorer, S, W, K)
    with pytest.warns(UserWarning, match="stock attention"):
        run_chunks(model, ids, cache, sizes=(8, 8, 8, 6))
        model(ids[:, :1], **with_cache(model, cache))  # the unused plan is noticed at the next update
    tok = run_tokens(model, ids, KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="knorm"))
    torch.testing.assert_close(tok, ref, atol=2e-5, rtol=0)
