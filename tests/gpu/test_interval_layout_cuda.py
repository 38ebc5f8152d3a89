"""The training sparse attention over the interval layout (kvpop_hf/trainer/interval_layout.py), compiled
FlexAttention on CUDA: output, LSE and the gradients of query, key and value against the materialised-mask
reference (float32), and against the position-order block mask in bfloat16 at a longer sequence."""

import pytest
import torch

from kvpop_hf.ops.running_topk import running_topk
from kvpop_hf.trainer.sparse_attention import sparse_attention, sparse_attention_block_mask, sparse_attention_reference

pytestmark = pytest.mark.tier("unit")


def _inputs(device, dtype, b, hq, hkv, S, d, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, device=device, generator=g).to(dtype).requires_grad_(True)  # noqa: E731
    return make(b, hq, S, d), make(b, hkv, S, d), make(b, hkv, S, d)


def _grads(out, lse, inputs):
    w = torch.linspace(-1, 1, out.shape[-1], device=out.device)
    return torch.autograd.grad((out.float() * w).sum() + lse.sum(), inputs)


@pytest.mark.parametrize("S,s,w,k", [(1000, 4, 64, 120), (777, 0, 16, 300), (512, 2, 600, 10)])
def test_interval_layout_against_reference_fp32(device, S, s, w, k):
    q, key, value = _inputs(device, torch.float32, 1, 8, 2, S, 64, S)
    rt = running_topk(torch.randn(1, 2, S, device=device), s, w, k, backend="torch")
    out, lse = sparse_attention(q, key, value, rt, s, w, block_mask=sparse_attention_block_mask(rt, s, w, 4))
    ref_out, ref_lse = sparse_attention_reference(q, key, value, rt, s, w)
    torch.testing.assert_close(out, ref_out, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(lse, ref_lse, atol=5e-3, rtol=5e-3)
    for got, ref in zip(_grads(out, lse, (q, key, value)), _grads(ref_out, ref_lse, (q, key, value))):
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)


def test_interval_layout_against_position_order_bf16(device):
    S, s, w = 8192, 4, 256
    k = S // 8 - 260
    q, key, value = _inputs(device, torch.bfloat16, 1, 32, 8, S, 128, 1)
    rt = running_topk(torch.randn(1, 8, S, device=device), s, w, k, backend="torch")
    runs = []
    for method in ("interval", "analytic"):
        out, lse = sparse_attention(q, key, value, rt, s, w, block_mask=sparse_attention_block_mask(rt, s, w, 4, method))
        runs.append((out.float(), lse, *_grads(out, lse, (q, key, value))))
    for a, b in zip(*runs):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
