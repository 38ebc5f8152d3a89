"""A left-padded batch fed by hand (``model(ids, attention_mask=mask, cache=...)``, then one token at a time) under a
stock attention: the mask reaches the attention but never the cache, and the attention applies it to the cache's
slots, which are not in position order. Without per-row position ids the padding cannot be recognised, so the
cache refuses before the next call instead of giving wrong padded rows."""

import inspect

import pytest
import torch
from transformers import DynamicCache

from helpers import distinct_ids, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

PAD, LENGTH, STEPS = 40, 50, 6


def _passes_position_ids_to_update() -> bool:
    from transformers.models.qwen3 import modeling_qwen3

    return "kwargs=kwargs" in inspect.getsource(modeling_qwen3.Qwen3Attention.forward)


needs_position_ids = pytest.mark.skipif(not _passes_position_ids_to_update(),
                                        reason="this transformers version passes no attention kwargs to Cache.update")


def _batch(pad=PAD):
    """Two rows of 50 tokens, row 1 left-padded by ``pad`` tokens; six decode tokens per row."""
    ids = distinct_ids(2, LENGTH)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask, distinct_ids(2, STEPS, seed=5)


def _loop(model, cache, ids, mask, steps, positions=False):
    """The hand-written loop: the prompt with its mask, then one token at a time with the grown mask; position ids
    (from the mask, as generate makes them) only if ``positions``. Last logits [2, vocab]."""
    def pos(m, n):
        return (m.cumsum(-1) - 1).clamp_min(0)[:, -n:] if positions else None

    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos(mask, ids.shape[1]), **with_cache(model, cache)).logits
        for i in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(steps[:, i:i + 1], attention_mask=mask, position_ids=pos(mask, 1),
                        **with_cache(model, cache)).logits
    return out[:, -1]


def _budget_above_sequence(model):
    return KVpopCache(model.config, sinks=2, window=4, topk=100)  # B = 106 > 56 tokens: nothing is evicted


@needs_position_ids
def test_padded_batch_without_position_ids_is_refused():
    model = tiny_model("qwen3", attn="sdpa")
    ids, mask, steps = _batch()
    with pytest.raises(ValueError, match="no position_ids per row.*attn_implementation='kvpop'"):
        _loop(model, _budget_above_sequence(model), ids, mask, steps)


@needs_position_ids
def test_padded_batch_with_position_ids_is_refused():
    model = tiny_model("qwen3", attn="sdpa")
    ids, mask, steps = _batch()
    with pytest.raises(ValueError, match="this batch is padded"):
        _loop(model, _budget_above_sequence(model), ids, mask, steps, positions=True)


@needs_position_ids
def test_unpadded_batch_with_position_ids_equals_dynamic_cache():
    """The fix the error names for an unpadded batch: position ids per row."""
    model = tiny_model("qwen3", attn="sdpa")
    ids, mask, steps = _batch(pad=0)
    ref = _loop(model, DynamicCache(config=model.config), ids, mask, steps, positions=True)
    with pytest.warns(UserWarning, match="stock attention"):
        out = _loop(model, KVpopCache(model.config, sinks=2, window=4, topk=10), ids, mask, steps, positions=True)
    assert not torch.allclose(out, ref, atol=1e-3)  # evicting (B = 16 < 56): the warning is due and the result differs
    out = _loop(model, _budget_above_sequence(model), ids, mask, steps, positions=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_padded_batch_under_kvpop_attention_equals_dynamic_cache():
    """With the kvpop attention the same loop (no position ids) is right: the padding never enters the cache."""
    model = tiny_model("qwen3", attn="sdpa")
    ids, mask, steps = _batch()
    ref = _loop(model, DynamicCache(config=model.config), ids, mask, steps)
    model.set_attn_implementation("kvpop")
    out = _loop(model, _budget_above_sequence(model), ids, mask, steps)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
