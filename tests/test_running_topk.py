"""Tests for kvpop_hf.ops.running_topk (running top-k: torch reference, wavelet matrix, Triton Fenwick kernel)."""

import os

# Must be set before triton JIT-decorates the kernel (i.e. before
# kvpop_hf.ops.running_topk.fenwick_triton is first imported) so it runs on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvpop_hf.ops.running_topk import (
    RunningTopK,
    priority_ranks,
    running_topk,
    running_topk_reference,
    running_topk_triton,
    running_topk_wavelet,
    sparse_mask_reference,
)

pytestmark = pytest.mark.tier("unit")

FIELDS = ("rank", "cutoff", "boundary", "keep_new")

# (S, sinks, window, k): includes k=0, k > S, window > S, sinks=0, sinks >= S.
CONFIGS = [
    (1, 0, 1, 1),
    (7, 0, 1, 0),
    (16, 2, 3, 4),
    (16, 0, 1, 3),
    (23, 1, 4, 50),
    (20, 3, 40, 2),
    (30, 0, 5, 1),
    (33, 4, 2, 8),
    (12, 12, 2, 3),
    (10, 15, 1, 2),
    (40, 2, 6, 0),
    (64, 4, 8, 16),
]


def _prio(shape, tied, seed):
    g = torch.Generator().manual_seed(seed)
    if tied:
        return torch.randint(0, 3, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def _better(p, a, b):
    """Token a strictly better than b: higher prio, ties -> newer."""
    return (p[a], a) > (p[b], b)


def _brute_row(p, s, w, k):
    """Plain-loop brute force for one row (p: list of floats)."""
    S = len(p)
    key = lambda t: (p[t], t)  # noqa: E731
    ranked = sorted(range(s, S), key=key, reverse=True)
    rank = [-1] * S
    for r, t in enumerate(ranked):
        rank[t] = r
    kept, cutoff, boundary, keep_new = [], [], [], []
    for q in range(S):
        E = [t for t in range(s, S) if t <= q - w]
        top = sorted(E, key=key, reverse=True)[:k]
        kept.append(set(top))
        if k == 0:
            cutoff.append(-1)
        elif len(E) >= k:
            cutoff.append(rank[top[-1]])
        else:
            cutoff.append(S)
        t_new = q - w
        E_prev = [t for t in E if t != t_new]
        if t_new >= s and k >= 1 and len(E_prev) >= k:
            b = sorted(E_prev, key=key, reverse=True)[k - 1]
            boundary.append(b)
            keep_new.append(_better(p, t_new, b))
        else:
            boundary.append(-1)
            keep_new.append(False)
    return rank, kept, cutoff, boundary, keep_new


def _check_against_brute(prio, res, s, w, k):
    S = prio.shape[-1]
    flat = prio.reshape(-1, S)
    rows = flat.shape[0]
    f = {n: getattr(res, n).reshape(rows, S) for n in FIELDS}
    for i in range(rows):
        p = flat[i].tolist()
        rank, kept, cutoff, boundary, keep_new = _brute_row(p, s, w, k)
        assert f["rank"][i].tolist() == rank
        assert f["cutoff"][i].tolist() == cutoff
        assert f["boundary"][i].tolist() == boundary
        assert f["keep_new"][i].tolist() == keep_new
        for q in range(S):
            got = {
                t
                for t in range(s, S)
                if t <= q - w and f["rank"][i, t] <= f["cutoff"][i, q]
            }
            assert got == kept[q], (i, q)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_reference_matches_brute_force(cfg, tied):
    S, s, w, k = cfg
    prio = _prio((2, 3, S), tied, seed=hash(cfg) % 10_000 + tied)
    res = running_topk_reference(prio, s, w, k)
    assert isinstance(res, RunningTopK)
    for n in FIELDS:
        assert getattr(res, n).shape == prio.shape
    assert res.boundary.dtype == torch.int64
    assert res.keep_new.dtype == torch.bool
    _check_against_brute(prio, res, s, w, k)


def test_reference_leading_dims():
    prio = torch.randn(37)
    a = running_topk_reference(prio, 2, 3, 5)
    b = running_topk_reference(prio.view(1, 1, 37), 2, 3, 5)
    for n in FIELDS:
        assert torch.equal(getattr(a, n), getattr(b, n).view(37))
    _check_against_brute(prio.view(1, 37), b, 2, 3, 5)


def test_priority_ranks_ties_prefer_newer():
    prio = torch.tensor([9.0, 1.0, 2.0, 1.0, 2.0, 0.5])
    # sinks=1: token 0 excluded. Order: 4 (2.0, newer), 2, 3 (1.0 newer), 1, 5.
    assert priority_ranks(prio, 1).tolist() == [-1, 3, 1, 2, 0, 4]
    assert priority_ranks(prio, 0).tolist() == [0, 4, 2, 3, 1, 5]
    assert priority_ranks(prio, 10).tolist() == [-1] * 6


def _window_count(q, s, w):
    lo = max(s, q - w + 1)
    return max(0, q - lo + 1)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_mask_row_counts(cfg, tied):
    S, s, w, k = cfg
    prio = _prio((2, S), tied, seed=7)
    res = running_topk_reference(prio, s, w, k)
    M = sparse_mask_reference(res, s, w)
    assert M.shape == (2, S, S) and M.dtype == torch.bool
    assert not torch.triu(M, diagonal=1).any()  # causal
    for q in range(S):
        n_sink = min(s, q + 1)
        n_elig = max(0, q - w - s + 1)
        expect = n_sink + _window_count(q, s, w) + min(k, n_elig)
        assert M[:, q].sum(-1).tolist() == [expect, expect]


def _kernel_module():
    import kvpop_hf.ops.running_topk.fenwick_triton as ft

    if not ft._is_interpreted() and not torch.cuda.is_available():
        pytest.skip("fenwick_triton was imported without TRITON_INTERPRET=1 and no CUDA")
    return ft


class _LaunchSpy:
    def __init__(self, kernel):
        self.kernel = kernel
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize(
    "cfg,tied",
    [((1, 0, 1, 1), False), ((17, 0, 1, 0), True), ((24, 2, 3, 4), False),
     ((24, 2, 3, 4), True), ((31, 1, 4, 50), True), ((20, 3, 40, 2), False),
     ((12, 12, 2, 3), True), ((40, 0, 2, 1), True), ((128, 4, 8, 16), True)],
)
def test_triton_kernel_matches_reference(cfg, tied, monkeypatch):
    ft = _kernel_module()
    S, s, w, k = cfg
    rows_shape = (2, 2, S) if S <= 32 else (1, 1, S)
    prio = _prio(rows_shape, tied, seed=S * 31 + k + tied)
    dev = "cpu" if ft._is_interpreted() else "cuda"
    spy = _LaunchSpy(ft._running_topk_kernel)
    monkeypatch.setattr(ft, "_running_topk_kernel", spy)
    got = running_topk_triton(prio.to(dev), s, w, k)
    assert spy.grids == [(prio.numel() // S,)]  # the kernel really ran, 1 program/row
    ref = running_topk_reference(prio, s, w, k)
    for n in FIELDS:
        g = getattr(got, n).cpu()
        r = getattr(ref, n)
        assert g.dtype == r.dtype, n
        assert torch.equal(g, r), n


def test_running_topk_dispatch():
    prio = torch.randn(1, 2, 20)
    ref = running_topk_reference(prio, 1, 2, 3)
    for backend in ("torch", "auto"):
        out = running_topk(prio, 1, 2, 3, backend=backend)
        for n in FIELDS:
            assert torch.equal(getattr(out, n), getattr(ref, n))
    ft = _kernel_module()
    dev = "cpu" if ft._is_interpreted() else "cuda"
    out = running_topk(prio.to(dev), 1, 2, 3, backend="triton")
    for n in FIELDS:
        assert torch.equal(getattr(out, n).cpu(), getattr(ref, n))


# Extra wavelet configs: larger S (several wavelet levels, R not a power of
# two / exactly a power of two), window >= S, k == R, k == R + 1.
WAVELET_CONFIGS = CONFIGS + [
    (65, 1, 3, 7),
    (129, 0, 1, 64),
    (200, 8, 200, 5),
    (200, 8, 250, 5),
    (257, 0, 2, 257),
    (257, 1, 2, 256),
    (300, 3, 17, 297),
    (300, 3, 17, 298),
    (513, 2, 31, 100),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cfg", WAVELET_CONFIGS)
def test_wavelet_matches_reference(cfg, tied):
    S, s, w, k = cfg
    prio = _prio((2, 3, S), tied, seed=S * 131 + s * 17 + w * 7 + k + tied)
    got = running_topk_wavelet(prio, s, w, k)
    ref = running_topk_reference(prio, s, w, k)
    assert isinstance(got, RunningTopK)
    for n in FIELDS:
        g, r = getattr(got, n), getattr(ref, n)
        assert g.shape == prio.shape, n
        assert g.dtype == r.dtype, n
        assert torch.equal(g, r), n


@pytest.mark.parametrize("cfg", [(16, 2, 3, 4), (23, 1, 4, 50), (12, 12, 2, 3), (7, 0, 1, 0)])
def test_wavelet_matches_brute_force(cfg):
    S, s, w, k = cfg
    prio = _prio((2, S), True, seed=S + k)
    _check_against_brute(prio, running_topk_wavelet(prio, s, w, k), s, w, k)


def test_wavelet_leading_dims_and_empty():
    prio = torch.randn(37)
    a = running_topk_wavelet(prio, 2, 3, 5)
    b = running_topk_wavelet(prio.view(1, 1, 37), 2, 3, 5)
    ref = running_topk_reference(prio, 2, 3, 5)
    for n in FIELDS:
        assert torch.equal(getattr(a, n), getattr(b, n).view(37))
        assert torch.equal(getattr(a, n), getattr(ref, n))
    # no rows at all: empty outputs of the right shape / dtypes
    e = running_topk_wavelet(torch.randn(0, 3, 10), 1, 2, 3)
    for n in FIELDS:
        assert getattr(e, n).shape == (0, 3, 10)
    assert e.cutoff.dtype == torch.int64 and e.keep_new.dtype == torch.bool


def test_running_topk_dispatch_wavelet():
    prio = torch.randn(2, 3, 40)
    ref = running_topk_reference(prio, 2, 3, 4)
    out = running_topk(prio, 2, 3, 4, backend="wavelet")
    for n in FIELDS:
        assert torch.equal(getattr(out, n), getattr(ref, n))
    with pytest.raises(ValueError):
        running_topk(prio, 2, 3, 4, backend="wavelets")


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(2, 8), -1, 2, 3),
        (torch.randn(2, 8), 0, 0, 3),
        (torch.randn(2, 8), 0, 2, -1),
        (torch.randint(0, 3, (2, 8)), 0, 2, 3),
        (torch.tensor(1.0), 0, 2, 3),
        (torch.randn(2, 8), 1.5, 2, 3),
        ([0.1, 0.2], 0, 2, 3),
    ],
)
def test_bad_input_raises(args):
    for fn in (running_topk_reference, running_topk, running_topk_triton, running_topk_wavelet):
        with pytest.raises(ValueError):
            fn(*args)
    with pytest.raises(ValueError):
        running_topk(torch.randn(4), 0, 1, 1, backend="nope")
