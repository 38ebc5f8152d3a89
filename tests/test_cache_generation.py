"""Generation modes users rely on: long decoding at fixed memory, left padding, beam search, multi-turn."""

import pytest
import torch

from helpers import distinct_ids, left_padded, reference_logits, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

S, W, K = 2, 6, 8  # B = 16


@pytest.mark.parametrize("scorer", ["knorm", "mlstm"])
def test_fixed_memory_after_ten_times_budget(scorer):
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=scorer)
    ids = distinct_ids(2, 20)
    model.generate(ids, **with_cache(model, cache), max_new_tokens=1, do_sample=False, pad_token_id=0)
    # every buffer the cache holds (keys, values, positions, priorities, counts, scorer state) keeps its storage:
    # nothing is reallocated or grows, whatever the length (memory_bytes() alone would be constant by construction)
    ptrs = [[(t.data_ptr(), t.numel()) for t in layer._buffers()] for layer in cache.layers]
    model.generate(ids, **with_cache(model, cache), max_new_tokens=10 * cache.budget, min_new_tokens=10 * cache.budget,
                   do_sample=False, pad_token_id=0)
    assert cache.get_seq_length() >= 10 * cache.budget
    assert [[(t.data_ptr(), t.numel()) for t in layer._buffers()] for layer in cache.layers] == ptrs
    for li in range(len(cache.layers)):
        pos = cache.stored_positions(li)
        assert (pos >= 0).sum(-1).eq(cache.budget).all()  # every head holds exactly B entries
        assert all(len(set(row.tolist())) == cache.budget for row in pos.flatten(0, 1))


@pytest.mark.parametrize("scorer", ["knorm", "keydiff", "lagkv", "mlstm"])
def test_left_padding_matches_unpadded_rows(scorer):
    model = tiny_model("llama")
    rows = [distinct_ids(1, n, seed=n)[0] for n in (30, 21, 26)]
    ids, mask, width = left_padded(rows)
    kw = dict(sinks=S, window=W, topk=K, scorer=scorer)
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    for chunk in (None, 7):
        extra = {} if chunk is None else {"prefill_chunk_size": chunk}
        batched = model.generate(ids, attention_mask=mask, **with_cache(model, KVpopCache(model.config, **kw)), **gen,
                                 **extra)
        for i, r in enumerate(rows):
            single = model.generate(r[None], **with_cache(model, KVpopCache(model.config, **kw)), **gen)
            new = single.sequences[0, len(r):]  # may stop early at EOS
            assert torch.equal(batched.sequences[i, width:width + len(new)], new)
            for a, b in zip(batched.logits, single.logits):
                torch.testing.assert_close(a[i], b[0], atol=2e-5, rtol=0)


def test_padding_never_stored():
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 25)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K)
    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(model, cache))
    pos = cache.stored_positions(0)
    assert pos[1].max() == 25 - 9 - 1 and (pos[1][pos[1] >= 0] < 16).all()
    assert set(pos[1, 0, :S].tolist()) == {0, 1}  # the sinks are the first *real* tokens
    assert (pos[0] >= 0).sum(-1).eq(16).all() and (pos[1] >= 0).sum(-1).eq(16).all()


def _sequence_logprob(model, seq, prompt_len, cache_probe):
    ref, _ = reference_logits(model, seq[None], cache_probe.scorer, S, W, K)
    logp = ref[0, :-1].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
    return logp[prompt_len - 1:].sum()


def test_beam_search_matches_reference():
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 18, seed=7)
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="mlp")
    out = model.generate(ids, **with_cache(model, cache), num_beams=3, num_return_sequences=3, max_new_tokens=10,
                         do_sample=False, length_penalty=0.0, early_stopping=True, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    for seq, score in zip(out.sequences, out.sequences_scores):
        expect = _sequence_logprob(model, seq, ids.shape[1], cache)
        torch.testing.assert_close(score, expect, atol=1e-4, rtol=0)


def test_multi_turn_reuse_matches_reference():
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="mlstm")
    turn1 = distinct_ids(1, 15, seed=8)
    out1 = model.generate(turn1, **with_cache(model, cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    turn2 = torch.cat([out1, distinct_ids(1, 9, seed=9) + 0], dim=1)
    out2 = model.generate(turn2, **with_cache(model, cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert cache.get_seq_length() == out2.shape[1] - 1
    ref, _ = reference_logits(model, out2, cache.scorer, S, W, K)
    gen_positions = list(range(15, 23)) + list(range(out2.shape[1] - 8, out2.shape[1]))
    for p in gen_positions:
        assert ref[0, p - 1].argmax() == out2[0, p]
    cache.reset()
    assert cache.get_seq_length() == 0
    fresh = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="mlstm")
    fresh.scorer.load_state_dict(cache.scorer.state_dict())
    a = model.generate(turn1, **with_cache(model, cache), max_new_tokens=5, do_sample=False, pad_token_id=0)
    b = model.generate(turn1, **with_cache(model, fresh), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_sampling_runs_and_is_seeded():
    model = tiny_model("mistral")
    ids = distinct_ids(2, 20)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(model.generate(ids, **with_cache(model, KVpopCache(model.config, sinks=S, window=W, topk=K)),
                                   do_sample=True, top_k=20, max_new_tokens=30, pad_token_id=0))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] == 50


def test_with_cache_uses_the_installed_transformers_keyword():
    """`with_cache` passes the cache under the name this transformers version takes (`past_key_values` on
    5.17, `cache` later): generation uses the KVpopCache and raises no deprecation warning about it."""
    import warnings

    from kvpop_hf.compat import cache_kwarg

    model = tiny_model("qwen3", attn="kvpop").eval()
    ids = torch.randint(4, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = KVpopCache(model.config, sinks=2, window=4, topk=4, scorer="knorm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, **with_cache(model, cache, max_new_tokens=5, do_sample=False))
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    assert out.shape[1] == 45 and cache.get_seq_length() == 44
    assert cache_kwarg(model) in ("cache", "past_key_values")


def test_scorer_weights_follow_each_layers_device():
    """Layers on several devices (a device_map) each read the scorer on their own device, copied once:
    nothing moves between layers or steps ('meta' stands in for a second device on CPU)."""
    model = tiny_model("qwen3", layers=2)
    cache = KVpopCache(model.config, sinks=S, window=W, topk=K, scorer="mlstm", log_gamma=-0.3)
    home = cache.scorer
    k = torch.randn(1, 2, 3, 16)
    cache.layers[0].lazy_initialization(k, k)
    cache.layers[1].lazy_initialization(k.to("meta"), k.to("meta"))
    on_cpu, on_meta = cache.layers[0].scorer, cache.layers[1].scorer
    assert on_cpu is home and next(home.parameters()).device.type == "cpu"  # the scorer itself never moved
    assert on_meta is not home and {p.device.type for p in on_meta.parameters()} == {"meta"}
    assert all(t.device.type == "meta" for t in cache.layers[1].state)
    assert cache.scorer_for("meta") is on_meta  # one copy per device, reused
    assert cache.shared.log_gamma_for(1, "meta").device.type == "meta" and cache.log_gamma.device.type == "cpu"
