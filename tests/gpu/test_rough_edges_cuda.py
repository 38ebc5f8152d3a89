"""On CUDA, where ``generate`` compiles the decode step (CUDA graphs) for a KVpopCache: ``get_seq_length`` is an int
after a compiled run, ``reset()`` takes another batch size, and a right-padded batch generates as a DynamicCache."""

import pytest
import torch
from transformers import DynamicCache

from helpers import distinct_ids, tiny_model

from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")


def _generate(model, ids, cache, **kw):
    return model.generate(ids, **with_cache(model, cache, max_new_tokens=24, do_sample=False, **kw))


def test_compiled_generate_reset_and_another_batch(device):
    model = tiny_model("qwen3").to(device)
    budget = dict(sinks=2, window=8, topk=16)
    ids = distinct_ids(2, 40).to(device)
    cache = KVpopCache(model.config, **budget)
    out = _generate(model, ids, cache)
    n = cache.get_seq_length()
    assert type(n) is int and n == 40 + 23
    assert torch.equal(out, _generate(model, ids, KVpopCache(model.config, **budget), disable_compile=True))
    cache.reset()
    ids3 = distinct_ids(3, 30, seed=1).to(device)
    out3 = _generate(model, ids3, cache)
    assert cache.layers[0].keys.shape[0] == 3 and cache.get_seq_length() == 30 + 23
    assert torch.equal(out3, _generate(model, ids3, KVpopCache(model.config, **budget), disable_compile=True))


@pytest.mark.parametrize("scorer", ["knorm", "mlstm"])
def test_right_padded_batch_generates_as_dynamic_cache(device, scorer):
    model = tiny_model("qwen3").to(device)
    ids = distinct_ids(3, 14, seed=2).to(device)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[2, 12:] = 0
    kw = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    ref = _generate(model, ids, DynamicCache(config=model.config), **kw)
    out = _generate(model, ids, KVpopCache(model.config, sinks=2, window=8, topk=64, scorer=scorer), **kw)
    torch.testing.assert_close(out.logits[0], ref.logits[0], atol=2e-3, rtol=2e-3)
    assert torch.equal(out.sequences, ref.sequences)
