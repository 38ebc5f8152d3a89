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


# -- tiers ---------------------------------------------------------------------------------------------
# Every test file names its tier (`pytestmark = pytest.mark.tier("unit")`); a test may name another for itself
# (`@pytest.mark.tier("scripts")`), the closest one counts:
#   unit     the library's behaviour, called directly (the quick tier: `python -m pytest -m unit`)
#   scripts  commands, benchmarks, examples, the laboratory and the repository's own checks, run as a user
#            runs them (console commands, benchmark mains, GPU-script argument parsing, the results page)
#   quality  the shipped students' and the testbed teacher's answers on fixed problems (CPU, minutes)
TIERS = ("unit", "scripts", "quality")


def pytest_collection_modifyitems(config, items):
    import pytest

    missing = set()
    for item in items:
        mark = item.get_closest_marker("tier")
        tier = mark.args[0] if mark is not None and mark.args else None
        if tier not in TIERS:
            missing.add((os.path.relpath(str(item.fspath)), tier))
            continue
        item.add_marker(getattr(pytest.mark, tier))
    if missing:
        named = "; ".join(f"{path} ({'no tier' if tier is None else repr(tier)})" for path, tier in sorted(missing, key=str))
        raise pytest.UsageError(f"tests without a tier: {named}. Name one in the file: "
                                f'pytestmark = pytest.mark.tier("unit") (or "scripts", "quality").')
