"""Small API edges: a model instead of its config, what repr shows, when the stock-attention warning fires."""

import warnings

import pytest
import torch

from helpers import distinct_ids, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.baselines.dms import DMSCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")


def test_model_is_accepted_for_its_config():
    model = tiny_model("qwen3")
    cache = KVpopCache(model, sinks=2, window=4, topk=6)
    assert cache.kvpop_config.num_layers == model.config.num_hidden_layers == len(cache.layers)
    assert len(DMSCache(model).layers) == model.config.num_hidden_layers


@pytest.mark.parametrize("bad", ["Qwen/Qwen3-0.6B", {"num_layers": 2}])
def test_something_else_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"model's config.*model.config"):
        KVpopCache(bad)
    with pytest.raises(TypeError, match="DMSCache needs the model's config"):
        DMSCache(bad)


def test_repr_shows_budget_scorer_and_layers():
    model = tiny_model("qwen3", layers=3)
    text = repr(KVpopCache(model.config, sinks=2, window=4, topk=6, scorer="mlp"))
    assert text == "KVpopCache(sinks=2, window=4, topk=6, budget=12, scorer='mlp', layers=3)"
    assert repr(DMSCache(model.config, sinks=2, window=5)) == "DMSCache(sinks=2, window=5, layers=3)"


def _stock_warnings(model, ids, cache, sizes):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            i = 0
            for n in sizes:
                model(ids[:, i:i + n], **with_cache(model, cache))
                i += n
            model(ids[:, i:i + 1], **with_cache(model, cache))  # the last chunk is committed here
    return [r for r in record if "stock attention" in str(r.message)]


def test_stock_attention_warns_only_once_eviction_happened():
    model = tiny_model("qwen3", attn="sdpa")
    ids = distinct_ids(1, 40)
    # B = 20: chunks of 8 + 8 tokens fit, nothing is evicted, every query saw exactly its set
    assert _stock_warnings(model, ids, KVpopCache(model.config, sinks=2, window=4, topk=14), (8, 8)) == []
    # the third chunk (24 > 20 tokens) evicts: one warning, however many chunks follow
    got = _stock_warnings(model, ids, KVpopCache(model.config, sinks=2, window=4, topk=14), (8, 8, 8, 8))
    assert len(got) == 1 and "evicts" in str(got[0].message)
