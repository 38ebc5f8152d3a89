"""KVpopCache on hybrid models (sliding-window, linear-attention, softcapping, learned sinks): with a budget covering
the sequence it generates what the model's default cache (``DynamicCache`` under the model's eager attention)
generates, token for token; with a small budget its KVpop layers hold exactly ``B`` entries per head and the
sliding layers their window; chunked prefill equals token-by-token decoding."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from hybrid_helpers import HYBRIDS, VOCAB, WINDOW, hybrid_model, sliding_choice
from helpers import left_padded
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.layer import KVpopLayer

pytestmark = pytest.mark.tier("unit")

NAMES = sorted(HYBRIDS)
PROMPT, NEW = 20, 8  # prompt + new tokens > WINDOW: the sliding layers slide


def _ids(batch=1, length=PROMPT, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def _cache(model, name, budget=64, **kw):
    kw.setdefault("sliding_layers", sliding_choice(name))
    return KVpopCache(model.config, sinks=2, window=4, topk=budget - 6, **kw)


def _generate(model, attn, cache, ids, seed=0, **gen):
    model.set_attn_implementation(attn)
    torch.manual_seed(seed)
    gen = dict(dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True), **gen)
    with torch.no_grad():
        return model.generate(ids, **with_cache(model, cache), **gen)


def _assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["greedy", "sampled", "beam"])
def test_budget_covering_sequence_equals_default_cache(name, mode):
    model = hybrid_model(name)
    ids = _ids()
    gen = {"greedy": {}, "sampled": dict(do_sample=True, top_k=20),
           "beam": dict(num_beams=3, num_return_sequences=2, length_penalty=0.0, early_stopping=True)}[mode]
    ref = _generate(model, "eager", DynamicCache(config=model.config), ids, **gen)
    out = _generate(model, "kvpop", _cache(model, name), ids, **gen)
    _assert_same(out, ref)


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_batch_equals_default_cache(name):
    model = hybrid_model(name)
    rows = [_ids(1, n, seed=n)[0] for n in (PROMPT, PROMPT - 7, PROMPT - 3)]
    ids, mask, _ = left_padded(rows)
    ref = _generate(model, "eager", DynamicCache(config=model.config), ids, attention_mask=mask)
    out = _generate(model, "kvpop", _cache(model, name), ids, attention_mask=mask)
    _assert_same(out, ref)


@pytest.mark.parametrize("name", NAMES)
def test_small_budget_holds_b_entries_and_the_window(name):
    model = hybrid_model(name)
    cache = _cache(model, name, budget=10)
    ids = _ids(2, PROMPT)
    _generate(model, "kvpop", cache, ids, max_new_tokens=6)
    ref = DynamicCache(config=model.config)
    _generate(model, "eager", ref, ids, max_new_tokens=6)
    seen = PROMPT + 6 - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == ref.get_seq_length()
    assert cache.kvpop_layer_indices, "every tested model has KVpop layers"
    for i, layer in enumerate(cache.layers):
        if i in cache.kvpop_layer_indices:
            assert isinstance(layer, KVpopLayer)
            held = (cache.stored_positions(i) >= 0).sum(-1)
            assert bool((held == 10).all()), (i, held)
        elif isinstance(ref.layers[i], DynamicSlidingWindowLayer):  # transformers' fixed-size sliding layer
            assert isinstance(layer, StaticSlidingWindowLayer) and layer.keys.shape[2] == WINDOW
            assert ref.layers[i].keys.shape[2] == min(seen, WINDOW - 1)
        else:  # linear-attention state: the default cache's own layer
            assert type(layer) is type(ref.layers[i])


@pytest.mark.parametrize("name,sliding", [(n, None) for n in NAMES] + [("gemma3", "kvpop"), ("gpt_oss", "kvpop")])
def test_chunked_prefill_equals_token_by_token(name, sliding):
    """With a budget that evicts (B = 10 > the KVpop window 4, and on sliding KVpop layers a model window of 8)."""
    model = hybrid_model(name)
    model.set_attn_implementation("kvpop")
    ids = _ids(1, 24)
    logits = []
    for sizes in ([24], [5, 1, 7, 11], [1] * 24):
        # sliding KVpop layers score with a random-init MLP: Gemma3's k_norm leaves the key norms so close that
        # knorm's order among them is float noise, which differs between a chunk's matmul and a token's
        kw = {"sliding_layers": sliding, "scorer": "mlp"} if sliding else {}
        cache = _cache(model, name, budget=10, **kw)
        out, start = [], 0
        with torch.no_grad():
            for n in sizes:
                out.append(model(ids[:, start:start + n], **with_cache(model, cache)).logits)
                start += n
        logits.append(torch.cat(out, 1))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "gemma2"])
def test_kvpop_on_sliding_layers_keeps_the_window(name):
    """sliding_layers='kvpop': the sliding layers hold B entries and their queries see them inside the window, so a
    budget covering the sequence is still the model's own sliding attention (window 8 < sequence)."""
    model = hybrid_model(name)
    ids = _ids()
    ref = _generate(model, "eager", DynamicCache(config=model.config), ids)
    cache = _cache(model, name, sliding_layers="kvpop")
    out = _generate(model, "kvpop", cache, ids)
    _assert_same(out, ref)
    assert cache.kvpop_layer_indices == list(range(len(cache.layers)))
    small = _cache(model, name, budget=10, sliding_layers="kvpop")
    _generate(model, "kvpop", small, ids)
    for i in small.kvpop_layer_indices:
        assert bool(((small.stored_positions(i) >= 0).sum(-1) == 10).all())


def test_sliding_kvpop_refuses_a_stock_attention():
    model = hybrid_model("mistral")
    cache = _cache(model, "mistral")
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="attn_implementation='kvpop'"):
        model(_ids(), **with_cache(model, cache))
        model(_ids(1, 1), **with_cache(model, cache))


def test_only_sliding_layers_need_the_option():
    model = hybrid_model("mistral")
    with pytest.raises(ValueError, match="sliding_layers='kvpop'"):
        KVpopCache(model.config, sinks=2, window=4, topk=8)
    with pytest.raises(ValueError, match="sliding_layers"):
        KVpopCache(model.config, sinks=2, window=4, topk=8, sliding_layers="all")


def test_unsupported_layer_type_is_refused():
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg.layer_types = ["full_attention", "indexed_attention"]
    with pytest.raises(ValueError, match="indexed_attention"):
        KVpopCache(cfg, sinks=2, window=4, topk=8)


@pytest.mark.parametrize("name", ["gemma3", "qwen2", "qwen3_next", "olmo3"])
def test_stock_sdpa_attention_equals_default_cache(name):
    """Under sdpa the KVpop layers' unfilled slots need generate's prepared 4D masks: the hybrid cache is
    compileable (fixed-size sliding layers), as a full-attention KVpopCache is."""
    model = hybrid_model(name, attn="sdpa")
    ids = _ids()
    ref = _generate(model, "sdpa", DynamicCache(config=model.config), ids)
    cache = _cache(model, name)
    assert cache.is_compileable
    _assert_same(_generate(model, "sdpa", cache, ids), ref)


class _HybridReference:
    """Whole-sequence attention with the brute-force contract mask (tests/helpers.py) on the KVpop layers, cut to the
    model's window on sliding ones, causal (and windowed) elsewhere; the model's softcap and sinks applied."""

    def __init__(self, cache):
        self.cache, self.cfg = cache, cache.kvpop_config
        self.scorer_layer = {i: j for j, i in enumerate(cache.kvpop_layer_indices)}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from helpers import contract_mask, reference_priorities
        from kvpop_hf.attention_variants import AttentionVariant, causal_visible, variant_attention

        S, window = key.shape[2], kwargs.get("sliding_window")
        vis = causal_visible(S, S, window, key.device).expand(key.shape[0], key.shape[1], S, S)
        j = self.scorer_layer.get(module.layer_idx)
        if j is not None:
            prio = reference_priorities(self.cache.scorer, j, key, value, self.cfg.window)
            vis = vis & contract_mask(prio, self.cfg.sinks, self.cfg.window, self.cfg.topk)
        return variant_attention(query, key, value, vis, scaling, AttentionVariant.of(kwargs, module)), None


@pytest.mark.parametrize("name,sliding", [("gemma2", "window"), ("gpt_oss", "kvpop"), ("gemma3", "kvpop"),
                                          ("qwen3_next", "window")])
def test_evicting_prefill_equals_the_brute_force_contract(name, sliding):
    """Budget 2 + 4 + 4 on a 24-token prompt: each KVpop layer's queries see exactly R(q) (inside the model's window on a
    sliding KVpop layer), with the model's softcap / sinks."""
    from transformers import AttentionInterface, AttentionMaskInterface

    model = hybrid_model(name)
    ids = _ids(1, 24)
    cache = KVpopCache(model.config, sinks=2, window=4, topk=4, scorer="mlp", sliding_layers=sliding)
    model.set_attn_implementation("kvpop")
    with torch.no_grad():
        got = model(ids, **with_cache(model, cache)).logits
    AttentionInterface.register("kvpop_hybrid_ref", _HybridReference(cache))
    AttentionMaskInterface.register("kvpop_hybrid_ref", lambda *a, **k: None)
    model.set_attn_implementation("kvpop_hybrid_ref")
    with torch.no_grad():
        expect = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
