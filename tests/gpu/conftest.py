"""GPU tests: the Triton kernels compiled for CUDA (not interpreted) against their torch references, in float32
and bfloat16. The whole folder is skipped without CUDA; on a GPU machine run it in its own process
(``python -m pytest -q tests/gpu``): the kernels are compiled on first use, and a process that already ran them
under ``TRITON_INTERPRET=1`` (the CPU suite) keeps the interpreted ones: in a run with the CPU suite these tests skip,
and the ``compiled`` fixture refuses interpreted kernels. (tests/conftest.py leaves ``TRITON_INTERPRET`` unset when
tests/gpu is the only path given.)"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if str(item.fspath).startswith(HERE)]
    if not CUDA:
        reason = "needs a CUDA device (tests/gpu runs the Triton kernels compiled on the GPU)"
    elif len(mine) < len(items):  # the CPU suite in the same process runs the kernels interpreted
        reason = "run tests/gpu in a process of its own: `python -m pytest -q tests/gpu`"
    else:
        return
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device():
    return torch.device("cuda")


def _is_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


@pytest.fixture(scope="session")
def compiled():
    """Fails (instead of silently testing the interpreter) when a kernel was defined under TRITON_INTERPRET=1.
    The decode kernels are defined on first use: their getters define them here if no test has yet."""
    from kvpop_hf.ops import decode_attention, decode_eviction
    from kvpop_hf.ops import mlstm_decode
    from kvpop_hf.ops.running_topk import fenwick_triton

    kernels = {"split_decode_kernel": decode_attention.split_decode_kernel(),
               "evict_insert_kernel": decode_eviction.evict_insert_kernel(),
               "mlstm_decode_kernel": mlstm_decode.mlstm_decode_kernel(),
               "fenwick running top-k": fenwick_triton._running_topk_kernel}
    interpreted = [name for name, fn in kernels.items() if _is_interpreted(fn)]
    assert not interpreted, (f"{interpreted} were defined under TRITON_INTERPRET=1: run tests/gpu in a process of "
                             f"its own, without TRITON_INTERPRET")
