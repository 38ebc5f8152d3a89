import os

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_TESTS = os.path.join(HERE, "gpu")


def pytest_configure(config):
    """Triton kernels run on CPU (the interpreter) in the suite, unless the run is tests/gpu alone: there the
    kernels and FlexAttention's inductor kernels must be compiled for the GPU. Decided before any test module
    imports a kernel (a kernel defined under the interpreter stays interpreted)."""
    paths = [os.path.abspath(str(arg).split("::")[0]) for arg in config.args]
    if paths and all(p == GPU_TESTS or p.startswith(GPU_TESTS + os.sep) for p in paths):
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
