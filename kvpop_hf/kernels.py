"""What the decode step's Triton kernels share: the optional import of Triton (which of a kernel and its
torch reference runs is chosen in kvpop_hf/backends.py)."""

from __future__ import annotations

try:  # kernels are defined at import of their modules, where Triton resolves `tl` as a global
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency; the torch references work without it
    triton = tl = None


