"""causal_attention (the fallback of the registered attention functions) against a plain softmax reference,
with shared KV heads (GQA) read in place and with an explicit mask; values and gradients."""

import math

import pytest
import torch

from kvpop_hf.ops.dense_attention import causal_attention

pytestmark = pytest.mark.tier("unit")


def reference(q, k, v, mask=None, scaling=None):
    """Explicit softmax attention; mask: bool ``[b, 1|Hq, L, S]`` (True = visible) or None for causal."""
    b, hq, L, d = q.shape
    S = k.shape[2]
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else 1 / math.sqrt(d))
    if mask is None:
        mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("L,S", [(7, 7), (1, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_attention_matches_reference(hq, hkv, L, S, masked):
    g = torch.Generator().manual_seed(hq * 100 + L * 10 + S + masked)
    q = torch.randn(2, hq, L, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, S, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, S, 16, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.rand(2, 1, L, S, generator=g) < 0.7
        mask[..., 0] = True  # every query sees something
    out = causal_attention(q, k, v, mask, scaling=0.3)
    ref = reference(q, k, v, mask, scaling=0.3)
    assert out.shape == (2, L, hq, 16) and out.is_contiguous()
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
