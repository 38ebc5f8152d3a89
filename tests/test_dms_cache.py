"""DMSCache against a brute-force simulation of the DMS rule: each token's decision is ``gate(value) > 0`` when
it is written; a marked token is visible while it is one of the last ``w`` tokens, then gone (sinks never)."""

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache

import kvpop_hf  # noqa: F401
from helpers import distinct_ids, tiny_model
from kvpop_hf.baselines.dms import DMSCache, DMSGate
from kvpop_hf.compat import with_cache
from references import hard_visibility_reference

pytestmark = pytest.mark.tier("unit")

SINKS, WINDOW = 2, 5
REF = "dms_test_reference"


def _gate(model, seed=0, bias=0.0):
    cfg = model.config
    g = DMSGate(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    torch.manual_seed(seed)
    with torch.no_grad():
        g.weight.normal_(0, 1.0)
        g.bias.fill_(bias)
    return g


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The whole sequence at once: decisions from the gate, visibility one entry at a time, plain softmax."""
    call = kwargs["dms_reference"]
    b, hq, S, d = query.shape
    hkv = key.shape[1]
    evict = call["gate"](module.layer_idx, value) > 0
    pos = torch.arange(S).expand(b, hkv, S)
    vis = hard_visibility_reference(torch.arange(S).expand(b, S), pos, evict, SINKS, WINDOW)  # [b, hkv, S, S]
    call["evict"][module.layer_idx] = evict
    g = hq // hkv
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    scores = (query @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~vis.repeat_interleave(g, 1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).contiguous(), None


AttentionInterface.register(REF, _reference_attention)
AttentionMaskInterface.register(REF, lambda *a, **k: None)


def _reference(model, gate, ids):
    call = {"gate": gate, "evict": {}}
    model.set_attn_implementation(REF)
    try:
        logits = model(ids, use_cache=False, dms_reference=call).logits
    finally:
        model.set_attn_implementation("kvpop")
    return logits, call["evict"]


def _kept_reference(evict, S):
    """Positions each head still holds after ``S`` tokens: ``[layers][b][h] -> set``."""
    out = {}
    for li, e in evict.items():
        b, h, _ = e.shape
        out[li] = [[{t for t in range(S) if t < SINKS or t > S - 1 - WINDOW or not bool(e[bi, hi, t])}
                    for hi in range(h)] for bi in range(b)]
    return out


def _stored(cache, li):
    pos = cache.stored_positions(li)
    return [[{int(p) for p in pos[bi, hi] if p >= 0} for hi in range(pos.shape[1])] for bi in range(pos.shape[0])]


@pytest.mark.parametrize("chunks", [[24], [7, 9, 8], [10] + [1] * 14])
def test_chunked_prefill_and_decode_equal_brute_force(chunks):
    model = tiny_model(layers=2)
    gate = _gate(model)
    ids = distinct_ids(2, sum(chunks))
    ref_logits, evict = _reference(model, gate, ids)
    assert any(bool(e.any()) for e in evict.values()) and not all(bool(e.all()) for e in evict.values())
    cache = DMSCache(model.config, gate=gate, sinks=SINKS, window=WINDOW)
    outs, start = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(model(ids[:, start:start + n], **with_cache(model, cache), use_cache=True).logits)
            start += n
            kept = _kept_reference({li: e[..., :start] for li, e in evict.items()}, start)
            for li in range(2):
                assert _stored(cache, li) == kept[li], (start, li)
    torch.testing.assert_close(torch.cat(outs, 1), ref_logits, atol=2e-5, rtol=1e-4)
    stats = cache.compression()
    kept_ref = torch.tensor([[[len(s) for s in row] for row in kept[li]] for li in range(2)], dtype=torch.float)
    assert torch.equal(stats["kept"], kept_ref)
    marked = torch.stack([e[..., SINKS:].float().sum(-1) for e in evict.values()]) / (ids.shape[1] - SINKS)
    torch.testing.assert_close(stats["eviction_ratio"], marked.mean(1))


def test_generate_memory_is_ragged_and_freed():
    model = tiny_model(layers=2)
    gate = _gate(model, seed=1, bias=1.0)  # evicts most tokens
    ids = distinct_ids(1, 12)
    cache = DMSCache(model.config, gate=gate, sinks=SINKS, window=WINDOW)
    out = model.generate(ids, **with_cache(model, cache), max_new_tokens=40, do_sample=False)
    seen = out.shape[1] - 1
    kept = cache.kept_counts()
    assert int(kept.max()) < seen  # tokens were freed ...
    assert len({int(x) for x in kept.flatten()}) > 1  # ... by different amounts per head
    for layer in cache.layers:  # storage grows only to the largest head (plus slack), not with the sequence
        assert layer.keys.shape[2] <= int(layer.live().max()) + 16
    # greedy tokens equal a brute-force run of the same rule over the generated sequence
    ref_logits, _ = _reference(model, gate, out)
    assert torch.equal(ref_logits[:, ids.shape[1] - 1:-1].argmax(-1), out[:, ids.shape[1]:])


def test_left_padded_batch_equals_rows_alone():
    model = tiny_model(layers=2)
    gate = _gate(model, seed=2)
    a, b = distinct_ids(1, 15, seed=3), distinct_ids(1, 11, seed=4)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = DMSCache(model.config, gate=gate, sinks=SINKS, window=WINDOW)
    out = model.generate(ids, attention_mask=mask, **with_cache(model, cache), max_new_tokens=8, do_sample=False)
    for row, x in ((0, a), (1, b)):
        alone = model.generate(x, **with_cache(model, DMSCache(model.config, gate=gate, sinks=SINKS, window=WINDOW)),
                               max_new_tokens=8, do_sample=False)
        assert torch.equal(out[row, -8:], alone[0, -8:])


def test_gate_that_never_evicts_is_the_dense_model():
    model = tiny_model(layers=2)
    ids = distinct_ids(1, 20)
    cache = DMSCache(model.config, sinks=SINKS, window=WINDOW)  # fresh gate: bias < 0, weights 0
    with torch.no_grad():
        got = model(ids[:, :13], **with_cache(model, cache)).logits
        got = torch.cat([got] + [model(ids[:, i:i + 1], **with_cache(model, cache)).logits for i in range(13, 20)], 1)
        ref = model(ids, **with_cache(model, DynamicCache())).logits
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert cache.compression()["kept_fraction"] == 1.0


def test_errors():
    model = tiny_model(layers=2)
    with pytest.raises(ValueError, match="window"):
        DMSCache(model.config, window=0)
    with pytest.raises(ValueError, match="Gate shape"):
        DMSCache(model.config, gate=DMSGate(3, 2, 16))
    with pytest.raises(ValueError, match="values"):
        DMSGate(2, 2, 16)(0, torch.zeros(1, 3, 4, 16))
    cache = DMSCache(model.config)
    with pytest.raises(ValueError, match="empty"):
        cache.compression()
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation='kvpop'"):
        with torch.no_grad():
            model(distinct_ids(1, 6), **with_cache(model, cache))
    model.set_attn_implementation("kvpop")
    with pytest.raises(FileNotFoundError, match="no such directory: /nonexistent/dms"):
        DMSCache.from_pretrained("/nonexistent/dms")


def test_save_and_load(tmp_path):
    model = tiny_model(layers=2)
    gate = _gate(model, seed=5)
    cache = DMSCache(model.config, gate=gate, sinks=SINKS, window=WINDOW)
    cache.save_pretrained(tmp_path)
    loaded = DMSCache.from_pretrained(tmp_path, model.config)
    assert (loaded.dms_config.sinks, loaded.dms_config.window) == (SINKS, WINDOW)
    torch.testing.assert_close(loaded.gate.weight, gate.weight)


def test_right_padded_batch_with_a_gate_that_never_evicts_generates_as_dynamic_cache():
    """generate reads a right-padded row's last (padding) position: that query sees what a DynamicCache shows it."""
    model = tiny_model(layers=2)
    ids = distinct_ids(2, 12, seed=5)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **with_cache(model, DynamicCache(config=model.config)), **kw)
    cache = DMSCache(model.config, sinks=SINKS, window=WINDOW)  # fresh gate: never evicts
    out = model.generate(ids, **with_cache(model, cache), **kw)
    torch.testing.assert_close(out.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(out.sequences, ref.sequences)
    assert type(cache.get_seq_length()) is int
