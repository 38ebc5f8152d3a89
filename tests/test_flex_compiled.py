"""One compiled-FlexAttention helper serves the inference attention and the training passes."""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kvpop_hf.ops import chunk_attention
from kvpop_hf.ops.flex_compiled import (INFERENCE_DYNAMIC, TRAINING_DYNAMIC, compiled_create_block_mask, compiled_flex,
                                        training_flex)
import pytest

pytestmark = pytest.mark.tier("unit")


def test_eager_off_cuda():
    assert compiled_flex("cpu", False) is flex_attention and compiled_create_block_mask("cpu") is create_block_mask
    assert training_flex(torch.device("cpu")) is flex_attention
    assert chunk_attention._flex_fns("cpu") == (flex_attention, create_block_mask)


def test_one_compiled_function_per_device_and_policy():
    """torch.compile only wraps here (it compiles at the first call), so this runs without a GPU."""
    cuda = torch.device("cuda")
    train, infer = training_flex(cuda), chunk_attention._flex_fns("cuda")[0]
    assert train is compiled_flex("cuda", TRAINING_DYNAMIC) and train is training_flex(cuda)
    assert INFERENCE_DYNAMIC is True and infer is compiled_flex("cuda", True) and infer is not train and infer is not flex_attention


def test_the_training_flex_raises_the_recompile_limit_for_its_calls_only(monkeypatch):
    """The recompile limit is patched around each training call; the global dynamo config is left alone."""
    from kvpop_hf.ops import flex_compiled

    cfg = torch._dynamo.config
    before = cfg.recompile_limit
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: lambda *a: seen.append(cfg.recompile_limit))
    flex_compiled._compiled(flex_attention, "cuda", False)(1)
    assert seen == [max(before, flex_compiled.MIN_RECOMPILE_LIMIT)] and cfg.recompile_limit == before
    flex_compiled._compiled(flex_attention, "cuda", None)(1)
    assert seen[-1] == before


def _causal_after(stored: int):
    """Query ``i`` of a chunk sees the ``stored`` keys before the chunk and the chunk's keys up to its own."""
    return lambda b, h, qi, ki: ki <= qi + stored


def test_the_inference_flex_compiles_once_for_a_first_chunk_and_the_next():
    """The inference function traced on CPU (inductor): a first chunk attending its own keys only (query and key
    lengths equal) and a second chunk with stored keys before its own (longer keys) share one graph; with duck
    sizing the second would recompile on ``key.size(2) == query.size(2)``."""
    from torch._dynamo.utils import counters

    from kvpop_hf.ops import flex_compiled

    torch._dynamo.reset()
    counters.clear()
    fn = flex_compiled._compiled(flex_attention, "cuda", INFERENCE_DYNAMIC)  # "cuda": the key only; CPU tensors
    calls = []
    for lq, lk in ((256, 256), (256, 512), (384, 896)):  # (a chunk of one 128-query block would recompile: 0/1)
        q, k, v = torch.randn(1, 2, lq, 16), torch.randn(1, 2, lk, 16), torch.randn(1, 2, lk, 16)
        mask = create_block_mask(_causal_after(lk - lq), 1, 1, lq, lk, device="cpu")
        calls.append(((q, k, v), mask, fn(q, k, v, block_mask=mask)))
    assert counters["stats"]["unique_graphs"] == 1
    for (q, k, v), mask, out in calls:  # the eager reference after the count (eager flex traces graphs of its own)
        torch.testing.assert_close(out, flex_attention(q, k, v, block_mask=mask), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
