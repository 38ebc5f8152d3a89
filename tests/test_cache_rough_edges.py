"""What a new user meets first: reset() and batch size, batch_select_indices with sequences, get_seq_length as an int,
topk bounded by the longest sequence (and refused clearly when it cannot fit), right-padded prompts under the kvpop
attention equal to DynamicCache."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from kvpop_hf import KVpopCache
from kvpop_hf.allocation import slots_for_topk
from kvpop_hf.compat import with_cache

from helpers import distinct_ids, tiny_model

pytestmark = pytest.mark.tier("unit")

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _prefill(model, cache, ids, mask=None):
    with torch.no_grad():
        model(input_ids=ids, **with_cache(model, cache, use_cache=True,
                                          attention_mask=mask if mask is not None else torch.ones_like(ids)))


def test_reset_accepts_another_batch_size():
    model = tiny_model()
    cache = KVpopCache(model.config, sinks=2, window=4, topk=4)
    _prefill(model, cache, distinct_ids(1, 12))
    with pytest.raises(ValueError, match="reset"):
        _prefill(model, cache, distinct_ids(3, 12))
    cache.reset()
    ids = distinct_ids(3, 12, seed=1)
    out = model.generate(ids, **with_cache(model, cache, max_new_tokens=5, do_sample=False))
    fresh = KVpopCache(model.config, sinks=2, window=4, topk=4)
    ref = model.generate(ids, **with_cache(model, fresh, max_new_tokens=5, do_sample=False))
    assert torch.equal(out, ref)
    assert cache.layers[0].keys.shape[0] == 3
    cache.reset()  # and back to one row
    one = model.generate(ids[:1], **with_cache(model, cache, max_new_tokens=5, do_sample=False))
    assert torch.equal(one, ref[:1])


@pytest.mark.parametrize("indices", [(0, 2), [0, 2], torch.tensor([0, 2]), torch.tensor([True, False, True])])
def test_batch_select_indices_takes_sequences_like_dynamic_cache(indices):
    model = tiny_model()
    ids = distinct_ids(3, 10)
    cache, ref = KVpopCache(model.config, sinks=2, window=4, topk=8), DynamicCache(config=model.config)
    _prefill(model, cache, ids)
    _prefill(model, ref, ids)
    before = cache.stored_positions(0).clone()
    cache.batch_select_indices(indices)
    ref.batch_select_indices(indices)
    assert torch.equal(cache.stored_positions(0), before[[0, 2]])
    assert cache.layers[0].keys.shape[0] == ref.layers[0].keys.shape[0] == 2


def test_get_seq_length_is_an_int_like_dynamic_cache():
    model = tiny_model()
    cache, ref = KVpopCache(model.config, sinks=2, window=4, topk=4), DynamicCache(config=model.config)
    assert cache.get_seq_length() == 0
    ids = distinct_ids(1, 9)
    _prefill(model, cache, ids)
    _prefill(model, ref, ids)
    n = cache.get_seq_length()
    assert type(n) is int and n == ref.get_seq_length() == 9


def test_get_seq_length_stays_a_tensor_inside_a_compiled_forward():
    """A model that computes its positions from ``get_seq_length`` (no position_ids passed) compiles in one graph:
    no int() of the counter inside the traced call."""
    model = tiny_model()
    cache = KVpopCache(model.config, sinks=2, window=4, topk=4)
    ids = distinct_ids(1, 9)
    _prefill(model, cache, ids)
    eager_cache = KVpopCache(model.config, sinks=2, window=4, topk=4)
    _prefill(model, eager_cache, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    nxt = distinct_ids(1, 1, seed=3)
    with torch.no_grad():
        out = compiled(input_ids=nxt, **with_cache(model, cache, use_cache=True)).logits
        ref = model(input_ids=nxt, **with_cache(model, eager_cache, use_cache=True)).logits
    torch.testing.assert_close(out, ref)
    assert cache.get_seq_length() == 10


def test_topk_beyond_the_longest_sequence_is_not_allocated():
    model = tiny_model(max_position_embeddings=64)
    ids = distinct_ids(1, 40)
    big = KVpopCache(model.config, sinks=2, window=8, topk=10**6)
    exact = KVpopCache(model.config, sinks=2, window=8, topk=54)
    assert slots_for_topk(2, 8, 10**6, 64) == 54
    a = model.generate(ids, **with_cache(model, big, max_new_tokens=20, do_sample=False))
    b = model.generate(ids, **with_cache(model, exact, max_new_tokens=20, do_sample=False))
    assert torch.equal(a, b)
    assert big.layers[0].keys.shape[2] == 64 and big.memory_bytes() == exact.memory_bytes()
    assert big.kvpop_config.topk == 10**6  # the setting stays as given (and is what a checkpoint saves)


def test_impossible_topk_is_refused_clearly():
    model = tiny_model(max_position_embeddings=10**12)
    cache = KVpopCache(model.config, sinks=2, window=8, topk=10**11)
    with pytest.raises(ValueError, match="Choose a smaller topk"):
        _prefill(model, cache, distinct_ids(1, 8))


@pytest.mark.parametrize("arch,chunk,scorer", [("qwen3", "dense", "knorm"), ("llama", "dense", "mlstm"),
                                               ("qwen3", "flex", "knorm"), ("qwen3", "dense", "tova")])
def test_right_padded_batch_generates_as_dynamic_cache(arch, chunk, scorer):
    """generate reads a right-padded row's last (padding) position for the first new token: that query sees what it
    sees under a DynamicCache (every real token before it), with a budget covering the sequence."""
    model = tiny_model(arch)
    ids = distinct_ids(3, 14, seed=2)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[2, 12:] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, **with_cache(model, DynamicCache(config=model.config), **kw), output_logits=True,
                         return_dict_in_generate=True)
    cache = KVpopCache(model.config, sinks=2, window=8, topk=64, scorer=scorer, backends={"chunk_attention": chunk})
    out = model.generate(ids, **with_cache(model, cache, **kw), output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(out.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(out.sequences, ref.sequences)
