"""Each Triton kernel of the decode step, compiled on CUDA, against its torch reference on the same inputs, in
float32 and bfloat16 buffers (the dtypes models decode in).

Tolerances: the split-KV attention multiplies with ``tl.dot``, which rounds float32 operands to TF32 (10-bit
mantissa) on Ampere and later, and in bf16 casts the softmax weights to bf16 before the ``P @ V`` product; it is
compared with the float32 SDPA of the same (rounded) inputs at 5e-3 (float32) and 3e-2 (bf16) absolute/relative.
The eviction kernel only moves data: bit-equal. The fused mLSTM step computes in float32 from the loaded
keys/values in both paths: 1e-3 (the bar of benchmarks/generation_speed.py's check)."""

import pytest
import torch

from kvpop_hf.ops.decode_attention import decode_attention_reference, decode_attention_triton
from kvpop_hf.ops.decode_eviction import evict_and_insert_reference, evict_and_insert_triton

DTYPES = [torch.float32, torch.bfloat16]
ATTN_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}

pytestmark = [pytest.mark.tier("unit"), pytest.mark.usefixtures("compiled")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,hq,hkv,B,d,dv", [(1, 32, 8, 4356, 128, 128), (3, 8, 2, 200, 64, 64),
                                             (8, 16, 4, 1000, 128, 128), (2, 7, 1, 130, 64, 32)])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_split_decode_attention(device, dtype, b, hq, hkv, B, d, dv, splits):
    g = torch.Generator(device=device).manual_seed(b * B + d)
    for scaling in (None, 0.05):
        q = torch.randn(b, hq, 1, d, device=device, generator=g).to(dtype)
        k = (3 * torch.randn(b, hkv, B, d, device=device, generator=g)).to(dtype)
        v = torch.randn(b, hkv, B, dv, device=device, generator=g).to(dtype)
        seen = torch.randint(1, 2 * B, (b,), device=device, generator=g)
        seen[0] = 1
        got = decode_attention_triton(q, k, v, seen, scaling, splits=splits)
        assert got.dtype == dtype and got.shape == (b, 1, hq, dv)
        ref = decode_attention_reference(q.float(), k.float(), v.float(), seen, scaling)
        tol = ATTN_TOL[dtype]
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s,w,k", [(4, 256, 3836), (4, 16, 44), (0, 8, 0), (2, 4, 7), (1, 64, 100)])
@pytest.mark.parametrize("ties", [False, True])
def test_evict_and_insert(device, dtype, s, w, k, ties):
    b, h, d, dv = 3, 8, 128, 64
    B = s + w + k
    g = torch.Generator(device=device).manual_seed(B + ties)
    for _ in range(5):
        seen = torch.randint(0, 3 * B, (b,), device=device, generator=g)
        seen[0] = B + w  # a full cache
        keys = torch.randn(b, h, B, d, device=device, generator=g).to(dtype)
        values = torch.randn(b, h, B, dv, device=device, generator=g).to(dtype)
        slot = torch.arange(B, device=device)
        pos = torch.where(slot < seen.clamp(max=B)[:, None], slot * 3, -1)[:, None].expand(b, h, B).contiguous()
        prio = torch.randn(b, h, B, device=device, generator=g)
        prio = torch.where(pos >= 0, prio.round() if ties else prio, float("-inf"))
        k_new = torch.randn(b, h, d, device=device, generator=g).to(dtype)
        v_new = torch.randn(b, h, dv, device=device, generator=g).to(dtype)
        p_leave = torch.randn(b, h, device=device, generator=g)
        p_leave = p_leave.round() if ties else p_leave
        p_new = torch.where(torch.rand(b, h, device=device, generator=g) < 0.5, float("-inf"),
                            torch.randn(b, h, device=device, generator=g))
        ref = [x.clone() for x in (keys, values, pos, prio)]
        got = [x.clone() for x in (keys, values, pos, prio)]
        evict_and_insert_reference(*ref, seen, k_new, v_new, p_leave, p_new, s, w, k)
        evict_and_insert_triton(*got, seen, k_new, v_new, p_leave, p_new, s, w, k)
        for name, a, e in zip(("keys", "values", "pos", "prio"), got, ref):
            assert torch.equal(a, e), name
        assert not torch.equal(got[2], pos)  # the step stored the new token


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("token", [False, True])
@pytest.mark.parametrize("decay", [False, True])
def test_fused_mlstm_step(device, dtype, delayed, token, decay):
    from kvpop_hf.scorers.mlstm import MLSTMScorer
    from kvpop_hf.scorers.mlstm_decode_triton import mlstm_decode_priority_reference, mlstm_decode_priority_triton

    b, h, d, (s, w, k), layers = 2, 8, 128, (4, 64, 424), 2
    B = s + w + k
    g = torch.Generator(device=device).manual_seed(7)
    for trial in range(3):
        scorer = MLSTMScorer(layers, h, d, delayed=delayed, token_readout=token, seed=trial).to(device)
        with torch.no_grad():  # biases away from their initial values
            for p in (scorer.bi, scorer.bf, scorer.b) + ((scorer.bt,) if token else ()):
                p.add_(torch.randn(p.shape, device=device, generator=g))
        keys = torch.randn(b, h, B, d, device=device, generator=g).to(dtype)
        values = torch.randn(b, h, B, d, device=device, generator=g).to(dtype)
        pos = torch.randint(-1, 4 * B, (b, h, B), device=device, generator=g)
        seen = torch.randint(0, 4 * B, (b,), device=device, generator=g)
        k_new = torch.randn(b, h, 1, d, device=device, generator=g).to(dtype)
        v_new = torch.randn(b, h, 1, d, device=device, generator=g).to(dtype)
        ds = scorer.state_dim
        C = torch.randn(b, h, ds, ds, device=device, generator=g)
        n = torch.randn(b, h, ds, device=device, generator=g)
        gamma = -torch.rand(h, device=device, generator=g) if decay else None
        args = (keys, values, pos, seen, k_new, v_new, s, w, gamma, 64, not delayed)
        with torch.no_grad():
            C_ref, n_ref = C.clone(), n.clone()
            p_ref = mlstm_decode_priority_reference(scorer, trial % layers, (C_ref, n_ref), *args)
            p = mlstm_decode_priority_triton(scorer, trial % layers, (C, n), *args)
        torch.testing.assert_close(p, p_ref, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(C, C_ref, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(n, n_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_decoding_with_the_kernels_matches_the_torch_path(device, dtype):
    """A KVpopCache decoding token by token on CUDA (all three kernels: the default there) == the same with
    ``backends`` ``torch``: the same tokens kept (positions bit-equal) and close logits. One layer: its keys, and so
    its priorities and evictions, do not depend on the attention's rounding (with more layers, TF32/bf16
    differences in one layer's output could flip a near-tie in the next one's eviction)."""
    from helpers import distinct_ids, tiny_model

    from kvpop_hf import KVpopCache
    from kvpop_hf.compat import with_cache

    model = tiny_model("qwen3", layers=1).to(device=device, dtype=dtype)
    ids = distinct_ids(2, 60, seed=3).to(device)
    runs = {}
    for mode in ("auto", "torch"):
        backends = dict.fromkeys(("mlstm_step", "decode_eviction", "decode_attention"), mode)
        cache = KVpopCache(model.config, sinks=2, window=4, topk=10, scorer="mlstm", log_gamma=-0.3, decay_step=5,
                           backends=backends)
        with torch.no_grad():
            logits = torch.cat([model(ids[:, i:i + 1], **with_cache(model, cache)).logits
                                for i in range(ids.shape[1])], 1)
        runs[mode] = logits.float(), [layer.pos.clone() for layer in cache.layers]
    (got, got_pos), (ref, ref_pos) = runs["auto"], runs["torch"]
    for a, e in zip(got_pos, ref_pos):
        assert torch.equal(a, e)
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
