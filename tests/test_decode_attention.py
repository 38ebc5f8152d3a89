"""The split-KV decode attention (Triton, interpreted on CPU) == its SDPA reference, on random inputs;
and a decode step through the cache uses it when asked."""

import pytest
import torch

from kvpop_hf.ops.decode_attention import (decode_attention_for, decode_attention_reference, decode_attention_triton,
                                       split_count)

pytestmark = pytest.mark.tier("unit")


def random_inputs(b, hq, hkv, B, d, dv, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    k = (2 * torch.randn(b, hkv, B, d, generator=g)).to(dtype)
    v = torch.randn(b, hkv, B, dv, generator=g).to(dtype)
    seen = torch.randint(1, 2 * B, (b,), generator=g)
    seen[0] = 1  # only the first slot visible
    return q, k, v, seen


@pytest.mark.parametrize("b,hq,hkv,B,d,dv", [(3, 8, 2, 200, 16, 16), (2, 4, 4, 64, 32, 8), (2, 7, 1, 130, 8, 24),
                                             (1, 16, 4, 257, 64, 64)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_split_kernel_matches_reference(b, hq, hkv, B, d, dv, splits):
    for seed in range(3):
        q, k, v, seen = random_inputs(b, hq, hkv, B, d, dv, seed)
        scaling = None if seed == 0 else 0.3
        ref = decode_attention_reference(q, k, v, seen, scaling)
        got = decode_attention_triton(q, k, v, seen, scaling, splits=splits)
        assert got.shape == ref.shape == (b, 1, hq, dv)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 2, 1), (128, 8, 2)])
def test_launch_configurations_match_reference(block_n, num_warps, num_stages):
    q, k, v, seen = random_inputs(2, 8, 2, 300, 32, 32, seed=4)
    ref = decode_attention_reference(q, k, v, seen, None)
    got = decode_attention_triton(q, k, v, seen, None, splits=3, block_n=block_n, num_warps=num_warps,
                                  num_stages=num_stages)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_rows_see_only_their_prefix():
    """Changing a slot at or past `seen` leaves the output alone; changing one before it does not."""
    q, k, v, _ = random_inputs(2, 4, 2, 96, 16, 16, seed=5)
    seen = torch.tensor([10, 96])
    out = decode_attention_triton(q, k, v, seen, None, splits=4)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 10:] = 100.0
    v2[0, :, 10:] = -7.0
    torch.testing.assert_close(decode_attention_triton(q, k2, v2, seen, None, splits=4), out)
    v2[0, :, 9] += 1.0
    assert not torch.allclose(decode_attention_triton(q, k2, v2, seen, None, splits=4)[0], out[0])


def test_split_count_covers_the_slots():
    for programs, slots in [(8, 4096), (256, 4096), (1, 100), (64, 63)]:
        ns, per = split_count(programs, slots)
        assert per % 64 == 0 and (ns - 1) * per < slots <= ns * per


def test_each_choice_names_its_function():
    assert decode_attention_for("triton") is decode_attention_triton
    assert decode_attention_for("torch") is decode_attention_reference


def test_cache_decode_with_split_kernels_matches_reference_mask(monkeypatch):
    """Every token a decode step, with the split attention and the fused eviction (both Triton):
    logits equal the independent reference mask. (The Triton interpreter cannot be traced by dynamo,
    so the compiled form is compared with eager on the GPU, by benchmarks/generation_speed.py.)"""
    from helpers import distinct_ids, reference_logits, tiny_model
    from kvpop_hf import KVpopCache
    from kvpop_hf.compat import with_cache

    monkeypatch.setenv("KVPOP_DECODE_ATTENTION", "triton")
    monkeypatch.setenv("KVPOP_DECODE_EVICTION", "triton")
    kw = dict(sinks=2, window=4, topk=6)
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 30, seed=3)
    cache = KVpopCache(model.config, scorer="mlp", **kw)
    ref, _ = reference_logits(model, ids, cache.scorer, kw["sinks"], kw["window"], kw["topk"])
    forward = lambda x: model(x, **with_cache(model, cache)).logits  # noqa: E731
    with torch.no_grad():
        out = torch.cat([forward(ids[:, i:i + 1]) for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=0)
