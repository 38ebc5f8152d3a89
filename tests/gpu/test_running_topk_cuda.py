"""The running top-k backends on CUDA (the Triton Fenwick-tree kernel compiled, the wavelet matrix, the torch
reference) return exactly the CPU reference's ranks, cutoffs, boundaries and keep flags, for float32 and
bfloat16 priorities (bf16 rounding makes many ties: the tie rule, newer wins, decides)."""

import pytest
import torch

from kvpop_hf.ops.running_topk import running_topk, running_topk_reference

pytestmark = pytest.mark.tier("unit")

FIELDS = ("rank", "cutoff", "boundary", "keep_new")
CONFIGS = [(1, 0, 1, 1), (16, 2, 3, 4), (23, 1, 4, 50), (33, 4, 2, 8), (12, 12, 2, 3), (40, 2, 6, 0),
           (512, 4, 32, 100), (4096, 4, 64, 424), (3000, 0, 1, 2999)]


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("S,sinks,window,k", CONFIGS)
@pytest.mark.parametrize("backend", ["triton", "wavelet", "torch"])
def test_backend_on_cuda_equals_the_cpu_reference(device, dtype, S, sinks, window, k, backend):
    g = torch.Generator().manual_seed(S + k)
    for tied in (False, True):
        prio = torch.randn(2, 3, S, generator=g)
        prio = (prio * 2).round() if tied else prio
        prio = prio.to(dtype)
        ref = running_topk_reference(prio.float(), sinks, window, k)
        got = running_topk(prio.to(device), sinks, window, k, backend=backend)
        for f in FIELDS:
            a, e = getattr(got, f), getattr(ref, f)
            assert a.device.type == "cuda" and a.shape == e.shape, f
            assert torch.equal(a.cpu().to(e.dtype), e), (f, tied)
