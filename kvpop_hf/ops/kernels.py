"""What the Triton kernels share: the lazy import of triton and block sizes (which of a kernel and its torch
reference runs is chosen in kvpop_hf/backends.py).

triton is optional (the ``gpu`` extra; CUDA builds of torch on Linux install it). kvpop_hf imports it only when a
kernel is first used: a kernel's module defines its kernels then, in a function decorated with :func:`lazy_kernel`
(which imports triton through :func:`require_triton`, naming the fix when it is missing). (torch's dynamo, which
transformers imports, may import an installed triton itself.)"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["MISSING_TRITON", "lazy_kernel", "next_pow2", "require_triton", "triton_available"]

MISSING_TRITON = ("{what} needs the `triton` package, which is not installed: `pip install -e \".[gpu]\"` (or "
                  "`pip install triton`; CUDA builds of torch on Linux install it){hint}.")


def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def require_triton(what: str = "This Triton kernel of kvpop_hf", hint: str = ""):
    """``(triton, triton.language)``, imported now; an ImportError naming the fix when triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(MISSING_TRITON.format(what=what, hint=hint)) from e
    return triton, tl


def lazy_kernel(what: str, hint: str = ""):
    """Decorator for ``define(triton, tl)``, a function that defines a Triton kernel (``@triton.jit``) and returns
    it: the decorated function takes no arguments, imports triton on its first call (an ImportError naming the fix,
    with ``what`` and ``hint``, without triton; the next call tries again), runs ``define`` once and returns that
    kernel from then on; ``.defined()`` says whether it has run. ``triton`` and ``tl`` are also bound as globals of
    ``define``'s module: that is where Triton looks up a kernel's names (``tl.constexpr`` annotations, which
    ``from __future__ import annotations`` leaves as strings, included)."""
    def wrap(define):
        kernels = []

        @functools.wraps(define)
        def kernel():
            if not kernels:
                triton, tl = require_triton(what, hint)
                define.__globals__.update(triton=triton, tl=tl)
                kernels.append(define(triton, tl))
            return kernels[0]

        kernel.defined = lambda: bool(kernels)
        return kernel

    return wrap


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): a Triton block size."""
    return 1 << max(int(n) - 1, 0).bit_length()
