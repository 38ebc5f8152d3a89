import math

import pytest
import torch

from kvpop_hf.ops.targets import (
    dense_causal_lse,
    future_attention_target,
    future_attention_target_reference,
)

pytestmark = pytest.mark.tier("unit")

ATOL = 1e-4


def _inputs(S, seed, B=2, Hq=4, Hkv=2, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k


def _masked_scores(q, k, scale=None):
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    sc = D ** -0.5 if scale is None else scale
    kk = k.float().repeat_interleave(Hq // Hkv, dim=1)
    s = q.float() @ kk.transpose(-1, -2) * sc
    S = q.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return s, causal


def _sparse_lse(q, k, seed, keep_prob=0.3):
    """LSE of a random sparse causal mask that always keeps the diagonal."""
    s, causal = _masked_scores(q, k)
    g = torch.Generator().manual_seed(seed + 1000)
    keep = torch.rand(s.shape, generator=g) < keep_prob
    keep = (keep & causal) | torch.eye(s.shape[-1], dtype=torch.bool)
    return torch.logsumexp(s.masked_fill(~keep, -math.inf), dim=-1)


@pytest.mark.parametrize("S", [37, 64, 96])
def test_dense_lse_matches_logsumexp(S):
    q, k = _inputs(S, seed=S)
    s, causal = _masked_scores(q, k)
    want = torch.logsumexp(s.masked_fill(~causal, -math.inf), dim=-1)
    for chunk in (1, 7, 1024):
        got = dense_causal_lse(q, k, chunk=chunk)
        assert got.shape == (2, 4, S) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_lse_custom_scale():
    q, k = _inputs(40, seed=3)
    s, causal = _masked_scores(q, k, scale=0.37)
    want = torch.logsumexp(s.masked_fill(~causal, -math.inf), dim=-1)
    torch.testing.assert_close(dense_causal_lse(q, k, scale=0.37, chunk=9), want, atol=1e-5, rtol=1e-5)


def _brute_force(q, k, lse, w, eps, agg, reduce="mean", query_mask=None):
    """Scalar-loop version of the definition for one tiny case (``reduce``: mean, max or power mean ``p<x>`` over
    the later queries, only those marked in ``query_mask [B, S]`` if given)."""
    x = 1.0 if reduce in ("mean", "max") else float(reduce[1:])
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    sc = D ** -0.5
    r = torch.empty(B, Hkv, S)
    for b in range(B):
        for h in range(Hkv):
            for t in range(S):
                ms = []
                ds = [d for d in range(t + w, S) if query_mask is None or bool(query_mask[b, d])]
                for j in range(h * G, (h + 1) * G):
                    ws = [math.exp(sc * float(q[b, j, d] @ k[b, h, t]) - float(lse[b, j, d])) for d in ds]
                    ms.append(max(ws, default=0.0) if reduce == "max" else
                              (sum(a ** x for a in ws) / max(1, len(ds))) ** (1 / x))
                if agg == "log_mean":
                    r[b, h, t] = math.log(eps + sum(ms) / G)
                else:
                    r[b, h, t] = sum(math.log(eps + m) for m in ms) / G
    return r


@pytest.mark.parametrize("agg", ["log_mean", "mean_log"])
def test_reference_matches_brute_force(agg):
    q, k = _inputs(11, seed=5, B=1, Hq=4, Hkv=2, D=8)
    lse = dense_causal_lse(q, k)
    ref = future_attention_target_reference(q, k, lse, 2, agg=agg)
    torch.testing.assert_close(ref, _brute_force(q, k, lse, 2, 1e-6, agg), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["flex", "chunked"])
@pytest.mark.parametrize("agg", ["log_mean", "mean_log"])
@pytest.mark.parametrize("window", [1, 4, 9])
@pytest.mark.parametrize("S,Hq,Hkv", [(37, 4, 2), (64, 4, 4), (96, 4, 1)])
@pytest.mark.parametrize("lse_kind", ["dense", "sparse"])
def test_transposed_matches_reference(backend, agg, window, S, Hq, Hkv, lse_kind):
    seed = S * 100 + window
    q, k = _inputs(S, seed=seed, Hq=Hq, Hkv=Hkv)
    lse = dense_causal_lse(q, k, chunk=16) if lse_kind == "dense" else _sparse_lse(q, k, seed)
    ref = future_attention_target_reference(q, k, lse, window, agg=agg)
    got = future_attention_target(q, k, lse, window, agg=agg, backend=backend, chunk=10)
    assert got.shape == (2, Hkv, S) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # tokens with no future query get exactly log(eps)
    tail = got[..., S - window:]
    torch.testing.assert_close(tail, torch.full_like(tail, math.log(1e-6)))
    # and the others are strictly above log(eps)
    assert (got[..., : S - window] > math.log(1e-6)).all()


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_dense_lse_target_upper_bound(backend):
    # With the dense LSE each A[d, t] <= 1, so m_t <= 1 and r <= log(1 + eps).
    q, k = _inputs(48, seed=11)
    lse = dense_causal_lse(q, k)
    r = future_attention_target(q, k, lse, 1, backend=backend)
    assert (r <= math.log(1 + 1e-6) + 1e-6).all()


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_custom_scale_and_eps(backend):
    q, k = _inputs(40, seed=21)
    lse = dense_causal_lse(q, k, scale=0.2)
    ref = future_attention_target_reference(q, k, lse, 3, eps=1e-3, scale=0.2)
    got = future_attention_target(q, k, lse, 3, eps=1e-3, scale=0.2, backend=backend)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_bf16_inputs(backend):
    q, k = _inputs(40, seed=7, dtype=torch.bfloat16)
    lse = dense_causal_lse(q, k)
    ref = future_attention_target_reference(q, k, lse, 4)
    got = future_attention_target(q, k, lse, 4, backend=backend)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_window_beyond_sequence(backend):
    # window >= S: no key has a future query -> everything log(eps), no NaN
    q, k = _inputs(8, seed=1)
    lse = dense_causal_lse(q, k)
    for w in (8, 20):
        got = future_attention_target(q, k, lse, w, backend=backend)
        torch.testing.assert_close(got, torch.full_like(got, math.log(1e-6)))
        ref = future_attention_target_reference(q, k, lse, w)
        torch.testing.assert_close(ref, got)
    # w = S - 1: only t = 0 sees a future query (d = S - 1)
    got = future_attention_target(q, k, lse, 7, backend=backend)
    torch.testing.assert_close(got, future_attention_target_reference(q, k, lse, 7), atol=ATOL, rtol=0)
    assert (got[..., 0] > math.log(1e-6)).all()
    torch.testing.assert_close(got[..., 1:], torch.full_like(got[..., 1:], math.log(1e-6)))


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_neg_inf_lse_query_contributes_nothing(backend):
    # A query with no visible key (LSE = -inf) must not produce inf / NaN.
    q, k = _inputs(20, seed=2)
    lse = dense_causal_lse(q, k)
    lse[:, :, 10] = -math.inf
    got = future_attention_target(q, k, lse, 2, backend=backend)
    ref = future_attention_target_reference(q, k, lse, 2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_bad_inputs():
    q, k = _inputs(16, seed=0)
    lse = dense_causal_lse(q, k)
    fns = [future_attention_target_reference,
           lambda *a, **kw: future_attention_target(*a, backend="flex", **kw),
           lambda *a, **kw: future_attention_target(*a, backend="chunked", **kw)]
    for fn in fns:
        with pytest.raises(ValueError):
            fn(q, k, lse, 0)
        with pytest.raises(ValueError):
            fn(q, k, lse, -2)
        with pytest.raises(ValueError):
            fn(q, k, lse, 1.5)
        with pytest.raises(ValueError):
            fn(q, k, lse, 1, agg="max")
        with pytest.raises(ValueError):
            fn(q, k, lse[:, :2], 1)  # lse heads must be Hq
        with pytest.raises(ValueError):
            fn(q, k, lse[..., :-1], 1)
        with pytest.raises(ValueError):
            fn(q, k[:, :, :-1], lse, 1)  # S mismatch
        with pytest.raises(ValueError):
            fn(q, k[..., :-1], lse, 1)  # D mismatch
        with pytest.raises(ValueError):
            fn(q, k[:1], lse, 1)  # B mismatch
        with pytest.raises(ValueError):
            fn(q[:, :3], k, lse[:, :3], 1)  # Hq=3 not multiple of Hkv=2
        with pytest.raises(ValueError):
            fn(q[0], k, lse, 1)  # wrong rank
        with pytest.raises(ValueError):
            fn(q, k, lse, 1, eps=0.0)
    with pytest.raises(ValueError):
        future_attention_target(q, k, lse, 1, backend="triton")
    with pytest.raises(ValueError):
        dense_causal_lse(q, k, chunk=0)
    with pytest.raises(ValueError):
        dense_causal_lse(q[:, :3], k)


# --- reduce="max": the largest future attention weight instead of the mean --------------------------------
@pytest.mark.parametrize("agg", ["log_mean", "mean_log"])
def test_max_reference_matches_brute_force(agg):
    q, k = _inputs(11, seed=6, B=1, Hq=4, Hkv=2, D=8)
    lse = dense_causal_lse(q, k)
    ref = future_attention_target_reference(q, k, lse, 2, agg=agg, reduce="max")
    torch.testing.assert_close(ref, _brute_force(q, k, lse, 2, 1e-6, agg, reduce="max"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("agg", ["log_mean", "mean_log"])
@pytest.mark.parametrize("window,S,Hq,Hkv", [(1, 37, 4, 2), (4, 64, 4, 4), (9, 96, 4, 1), (40, 30, 4, 2)])
@pytest.mark.parametrize("lse_kind", ["dense", "sparse"])
def test_max_chunked_matches_reference(agg, window, S, Hq, Hkv, lse_kind):
    seed = S * 10 + window
    q, k = _inputs(S, seed=seed, Hq=Hq, Hkv=Hkv)
    lse = dense_causal_lse(q, k) if lse_kind == "dense" else _sparse_lse(q, k, seed)
    ref = future_attention_target_reference(q, k, lse, window, agg=agg, reduce="max")
    got = future_attention_target(q, k, lse, window, agg=agg, backend="chunked", chunk=7, reduce="max")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)


def test_max_never_below_mean_and_bad_reduce():
    q, k = _inputs(40, seed=9)
    lse = dense_causal_lse(q, k)
    mx = future_attention_target(q, k, lse, 3, backend="chunked", reduce="max")
    mean = future_attention_target(q, k, lse, 3, backend="chunked")
    assert bool((mx >= mean - 1e-5).all())
    with pytest.raises(ValueError, match="backend='chunked' only"):
        future_attention_target(q, k, lse, 3, backend="flex", reduce="max")
    for bad in ("sum", "p1", "p0.5", "p", "pinf", "pnan", "p-3", 4):
        with pytest.raises(ValueError, match="reduce must be 'mean', 'max' or 'p<x>'"):
            future_attention_target(q, k, lse, 3, backend="chunked", reduce=bad)
        with pytest.raises(ValueError, match="reduce must be 'mean', 'max' or 'p<x>'"):
            future_attention_target_reference(q, k, lse, 3, reduce=bad)


# --- reduce="p<x>": the power mean of order x of the future attention weights -------------------------------
@pytest.mark.parametrize("x", [1.5, 4.0])
@pytest.mark.parametrize("masked", [False, True])
def test_power_mean_matches_a_loop_in_both_backends(x, masked):
    q, k = _inputs(13, seed=11, B=2, Hq=4, Hkv=2, D=8)
    lse = dense_causal_lse(q, k)
    mask = (torch.rand(2, 13, generator=torch.Generator().manual_seed(1)) > 0.4) if masked else None
    want = _brute_force(q, k, lse, 2, 1e-6, "log_mean", reduce=f"p{x:g}", query_mask=mask)
    ref = future_attention_target_reference(q, k, lse, 2, reduce=f"p{x:g}", query_mask=mask)
    got = future_attention_target(q, k, lse, 2, backend="chunked", chunk=5, reduce=f"p{x:g}", query_mask=mask)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_power_mean_lies_between_mean_and_max_and_grows_with_its_order():
    q, k = _inputs(40, seed=12)
    lse = dense_causal_lse(q, k)
    t = {r: future_attention_target(q, k, lse, 3, backend="chunked", reduce=r, agg="mean_log")
         for r in ("mean", "p2", "p8", "max")}
    assert bool((t["mean"] <= t["p2"] + 1e-5).all() and (t["p2"] <= t["p8"] + 1e-5).all())
    assert bool((t["p8"] <= t["max"] + 1e-5).all())
    assert not torch.allclose(t["p2"], t["mean"]) and not torch.allclose(t["p8"], t["max"])
    with pytest.raises(ValueError, match="backend='chunked' only"):
        future_attention_target(q, k, lse, 3, backend="flex", reduce="p2")
