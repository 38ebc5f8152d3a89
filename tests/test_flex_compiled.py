"""One compiled-FlexAttention helper serves the inference attention and the training passes."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kvpop_hf import chunk_attention
from kvpop_hf.flex_compiled import TRAINING_DYNAMIC, compiled_create_block_mask, compiled_flex
from kvpop_hf.trainer import sparse_attention


def test_eager_off_cuda():
    assert compiled_flex("cpu", False) is flex_attention and compiled_create_block_mask("cpu") is create_block_mask
    assert sparse_attention._flex(torch.device("cpu")) is flex_attention
    assert chunk_attention._flex_fns("cpu") == (flex_attention, create_block_mask)


def test_one_compiled_function_per_device_and_policy(monkeypatch):
    """torch.compile only wraps here (it compiles at the first call), so this runs without a GPU."""
    cuda = torch.device("cuda")
    monkeypatch.delenv("KVPOP_FLEX_DYNAMIC", raising=False)
    train, infer = sparse_attention._flex(cuda), chunk_attention._flex_fns("cuda")[0]
    assert train is compiled_flex("cuda", TRAINING_DYNAMIC) and train is sparse_attention._flex(cuda)
    assert infer is compiled_flex("cuda", None) and infer is not train and infer is not flex_attention
    monkeypatch.setenv("KVPOP_FLEX_DYNAMIC", "true")
    assert chunk_attention._flex_fns("cuda")[0] is compiled_flex("cuda", True)
    monkeypatch.setenv("KVPOP_FLEX_DYNAMIC", "0")
    assert chunk_attention._flex_fns("cuda")[0] is train


def test_bad_dynamic_setting_is_refused(monkeypatch):
    monkeypatch.setenv("KVPOP_FLEX_DYNAMIC", "yes")
    with pytest.raises(ValueError, match="KVPOP_FLEX_DYNAMIC must be 1, true, 0 or false"):
        chunk_attention._flex_fns("cuda")
