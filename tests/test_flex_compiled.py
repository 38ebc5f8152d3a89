"""One compiled-FlexAttention helper serves the inference attention and the training passes."""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kvpop_hf.ops import chunk_attention
from kvpop_hf.ops.flex_compiled import INFERENCE_DYNAMIC, TRAINING_DYNAMIC, compiled_create_block_mask, compiled_flex
from kvpop_hf.trainer import sparse_attention
import pytest

pytestmark = pytest.mark.tier("unit")


def test_eager_off_cuda():
    assert compiled_flex("cpu", False) is flex_attention and compiled_create_block_mask("cpu") is create_block_mask
    assert sparse_attention._flex(torch.device("cpu")) is flex_attention
    assert chunk_attention._flex_fns("cpu") == (flex_attention, create_block_mask)


def test_one_compiled_function_per_device_and_policy():
    """torch.compile only wraps here (it compiles at the first call), so this runs without a GPU."""
    cuda = torch.device("cuda")
    train, infer = sparse_attention._flex(cuda), chunk_attention._flex_fns("cuda")[0]
    assert train is compiled_flex("cuda", TRAINING_DYNAMIC) and train is sparse_attention._flex(cuda)
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
