"""offload()/prefetch() move a layer's whole state (keys, values, positions, priorities, counters, scorer state), not
only keys and values; ``offloading=True`` (transformers' per-update offloading) is refused with the reason."""

import copy

import pytest
import torch

from helpers import distinct_ids, run_tokens, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.baselines.dms import DMSCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")


def _tensors(layer):
    """Every tensor the layer holds: attribute name (with index inside tuples) -> tensor."""
    found = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, (tuple, list)):
            found.update({f"{name}[{i}]": x for i, x in enumerate(value) if isinstance(x, torch.Tensor)})
    return found


def _filled(make, seed=0):
    model = tiny_model("qwen3")
    cache = make(model)
    with torch.no_grad():
        model(distinct_ids(1, 30, seed=seed), **with_cache(model, cache))
    return model, cache


MAKERS = {
    "mlstm": lambda m: KVpopCache(m.config, sinks=2, window=5, topk=6, scorer="mlstm"),
    "tova": lambda m: KVpopCache(m.config, sinks=2, window=5, topk=6, scorer="tova"),
    "dms": lambda m: DMSCache(m.config, sinks=2, window=5),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_prefetch_moves_every_tensor_of_the_layer(kind):
    """The layer's device stands in for an accelerator (``meta``, on a throwaway copy): every tensor it holds
    follows, including the scorer's recurrent state and the counters."""
    _, cache = _filled(MAKERS[kind])
    layer = copy.deepcopy(cache).layers[1]
    names = set(_tensors(layer))
    assert {"keys", "values", "pos", "seen", "tokens"} <= names
    if kind == "mlstm":
        assert any(n.startswith("state[") for n in names)
    layer.device = torch.device("meta")
    layer.prefetch()
    moved = _tensors(layer)
    assert set(moved) == names and all(t.device.type == "meta" for t in moved.values())


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_offloaded_then_prefetched_cache_decodes_identically(kind):
    model, cache = _filled(MAKERS[kind])
    twin = copy.deepcopy(cache)
    for i in range(len(cache.layers)):
        cache.offload(i)  # transformers' Cache.offload -> the layer's offload
        assert all(t.device.type == "cpu" for t in _tensors(cache.layers[i]).values())
    for layer in cache.layers:
        layer.prefetch()
    tail = distinct_ids(1, 8, seed=9)
    torch.testing.assert_close(run_tokens(model, tail, cache), run_tokens(model, tail, twin), atol=0, rtol=0)


def test_offloading_cache_is_refused():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="offloading=True.*smaller budget"):
        KVpopCache(model.config, sinks=2, window=4, topk=6, offloading=True)
