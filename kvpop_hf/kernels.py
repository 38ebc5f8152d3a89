"""What the Triton kernels share: the lazy import of triton and block sizes (which of a kernel and its torch
reference runs is chosen in kvpop_hf/backends.py).

triton is optional (the ``gpu`` extra; CUDA builds of torch on Linux install it). kvpop_hf imports it only when a
kernel is first used: a kernel's module defines its kernels then, through :func:`require_triton`, which names the
fix when triton is missing. (torch's dynamo, which transformers imports, may import an installed triton itself.)"""

from __future__ import annotations

import importlib.util

__all__ = ["MISSING_TRITON", "next_pow2", "require_triton", "triton_available"]

MISSING_TRITON = ("{what} needs the `triton` package, which is not installed: `pip install \"kvpop-hf[gpu]\"` (or "
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


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): a Triton block size."""
    return 1 << max(int(n) - 1, 0).bit_length()
