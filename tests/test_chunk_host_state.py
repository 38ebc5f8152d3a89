"""The layer's host-side "all B slots in use" flag, which lets prompt chunks skip a device sync: it is set only
when the cache is full, stays right across decode steps (which never set it) and is cleared by reset()."""

import torch

from helpers import distinct_ids, reference_logits, run_chunks, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
import pytest

pytestmark = pytest.mark.tier("unit")


def test_full_flag_follows_the_stored_length():
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=2, window=4, topk=4, scorer="knorm")  # B = 10
    ids = distinct_ids(1, 30, seed=3)
    layer = lambda: cache.layers[0]  # noqa: E731
    with torch.no_grad():
        model(ids[:, :6], **with_cache(model, cache))
        assert not layer()._full_on_host and layer().stored_length() == 6
        for t in range(6, 9):  # decode steps: the flag is left alone, the length is read from the device
            model(ids[:, t:t + 1], **with_cache(model, cache))
        assert not layer()._full_on_host and layer().stored_length() == 9
        model(ids[:, 9:10], **with_cache(model, cache))
        assert layer().stored_length() == 10 and layer()._full_on_host  # learnt from the device once
        model(ids[:, 10:17], **with_cache(model, cache))
        assert layer()._full_on_host and layer().stored_length() == 10
    cache.reset()
    assert not layer()._full_on_host and layer().stored_length() == 0


def test_chunks_after_decode_steps_equal_the_reference():
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 60, seed=4)
    cache = KVpopCache(model.config, sinks=2, window=5, topk=6, scorer="mlp")
    ref, _ = reference_logits(model, ids, cache.scorer, 2, 5, 6, cache.log_gamma, cache.kvpop_config.decay_step)
    got = run_chunks(model, ids, cache, sizes=(4, 1, 1, 1, 1, 1, 9, 1, 17))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
