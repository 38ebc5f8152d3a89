"""``copy.deepcopy(cache)`` (transformers' prefix-reuse pattern): a copy filled with a shared prompt continues on its own,
after the original is gone, exactly as the reference for its whole sequence."""

import copy
import gc
import weakref

import pytest
import torch

from helpers import distinct_ids, reference_logits, run_chunks, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.baselines.dms import DMSCache, DMSGate
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

S, W, K = 2, 5, 6
PROMPT = 30


def _continuations(seed=0):
    """A prompt [1, 30] and two different continuations [1, 12] of it (no repeated token inside a sequence)."""
    ids = distinct_ids(1, PROMPT + 24, seed=seed)
    return ids[:, :PROMPT], ids[:, PROMPT:PROMPT + 12], ids[:, PROMPT + 12:]


def _fill_copy_and_drop(model, make, prompt, copies=2):
    """Fill a cache ``make()`` with ``prompt``, deep-copy it ``copies`` times and drop the original; checks that
    nothing the copies hold keeps the original alive."""
    cache = make()
    with torch.no_grad():
        model(prompt, **with_cache(model, cache))
    clones = [copy.deepcopy(cache) for _ in range(copies)]
    original = weakref.ref(cache)
    del cache
    gc.collect()
    assert original() is None, "a deep copy still refers to the original cache"
    return clones


def _interleaved(model, caches, tails):
    """Decode each cache's tail one token at a time, alternating between the caches; logits per cache."""
    out = [[] for _ in caches]
    with torch.no_grad():
        for i in range(tails[0].shape[1]):
            for j, (cache, tail) in enumerate(zip(caches, tails)):
                out[j].append(model(tail[:, i:i + 1], **with_cache(model, cache)).logits)
    return [torch.cat(o, 1) for o in out]


@pytest.mark.parametrize("scorer", ["knorm", "mlp", "mlstm"])
def test_deep_copies_continue_independently_as_the_reference(scorer):
    model = tiny_model("qwen3")
    prompt, tail_a, tail_b = _continuations()
    scorer_module = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=scorer).scorer
    make = lambda: KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=scorer_module)
    a, b = _fill_copy_and_drop(model, make, prompt)
    assert a.scorer is scorer_module and b.scorer is scorer_module  # frozen weights are shared
    assert all(la.shared is a.shared for la in a.layers) and a.shared is not b.shared
    for la, lb in zip(a.layers, b.layers):
        assert la.keys.data_ptr() != lb.keys.data_ptr() and la.seen.data_ptr() != lb.seen.data_ptr()
        if la.state is not None:  # the scorer's recurrent (per-sequence) state is copied
            assert all(x.data_ptr() != y.data_ptr() for x, y in zip(la.state, lb.state))
    out_a, out_b = _interleaved(model, [a, b], [tail_a, tail_b])
    for tail, out in ((tail_a, out_a), (tail_b, out_b)):
        ref, _ = reference_logits(model, torch.cat([prompt, tail], 1), scorer_module, S, W, K)
        torch.testing.assert_close(out, ref[:, PROMPT:], atol=2e-5, rtol=0)


def test_copy_of_a_chunk_left_by_a_stock_attention_is_committed_first():
    """Under sdpa the prompt chunk waits for the next update; a copy commits it first (with the usual warning), so
    the copy and the original continue alike."""
    model = tiny_model("qwen3", attn="sdpa")
    prompt, tail, _ = _continuations(seed=1)
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="mlstm")
    with pytest.warns(UserWarning, match="stock attention"):
        with torch.no_grad():
            model(prompt, **with_cache(model, cache))
        clone = copy.deepcopy(cache)
    assert all(layer.pending is None for layer in cache.layers + clone.layers)
    out_clone, out_orig = _interleaved(model, [clone, cache], [tail, tail])
    torch.testing.assert_close(out_clone, out_orig, atol=0, rtol=0)


@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_deep_copy_of_attention_scored_policy(policy):
    model = tiny_model("qwen3")
    prompt, tail_a, tail_b = _continuations(seed=2)
    make = lambda: KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=policy)
    a, b = _fill_copy_and_drop(model, make, prompt)
    out_a, out_b = _interleaved(model, [a, b], [tail_a, tail_b])
    for tail, out in ((tail_a, out_a), (tail_b, out_b)):  # the same steps on a cache never copied
        fresh = make()
        with torch.no_grad():
            model(prompt, **with_cache(model, fresh))
        torch.testing.assert_close(out, _interleaved(model, [fresh], [tail])[0], atol=0, rtol=0)


def test_deep_copy_of_dms_cache():
    model = tiny_model("qwen3")
    cfg = model.config
    gate = DMSGate(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 1.0)
    prompt, tail_a, tail_b = _continuations(seed=3)
    make = lambda: DMSCache(cfg, gate=gate, sinks=S, window=W)
    a, b = _fill_copy_and_drop(model, make, prompt)
    assert a.gate is gate and a.layers[0].gate is gate
    out_a, out_b = _interleaved(model, [a, b], [tail_a, tail_b])
    for tail, out in ((tail_a, out_a), (tail_b, out_b)):
        fresh = make()
        torch.testing.assert_close(out, run_chunks(model, torch.cat([prompt, tail], 1), fresh, sizes=(PROMPT,) + (1,) * 12)[:, PROMPT:],
                                   atol=0, rtol=0)
