"""kernels.lazy_kernel: a Triton kernel's definition runs once, on first use, with triton bound where Triton looks
up the kernel's names; without triton, an ImportError naming the fix, and a later call tries again."""

import sys

import pytest

from kvpop_hf.ops.kernels import lazy_kernel

pytestmark = pytest.mark.tier("unit")


def _probe():
    calls = []

    @lazy_kernel("probe_kernel (a test)", hint="; or the torch path")
    def probe_kernel(triton, tl):
        calls.append((triton, tl))
        return object()

    return probe_kernel, calls


def test_defines_once_on_first_use_and_binds_triton_in_the_module():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    probe_kernel, calls = _probe()
    assert not probe_kernel.defined() and calls == []  # nothing at decoration time
    kernel = probe_kernel()
    assert probe_kernel() is kernel and probe_kernel.defined() and calls == [(triton, tl)]
    assert globals()["triton"] is triton and globals()["tl"] is tl  # the defining module's globals


def test_without_triton_the_error_names_the_fix_and_a_later_call_retries(monkeypatch):
    pytest.importorskip("triton")
    probe_kernel, calls = _probe()
    with monkeypatch.context() as patch:
        for name in ("triton", "triton.language"):
            patch.setitem(sys.modules, name, None)  # as if triton were not installed
        with pytest.raises(ImportError, match=r'probe_kernel \(a test\) needs the `triton` package.*'
                                              r'pip install -e "\.\[gpu\]".*; or the torch path'):
            probe_kernel()
    assert not probe_kernel.defined() and calls == []
    probe_kernel()
    assert probe_kernel.defined() and len(calls) == 1
