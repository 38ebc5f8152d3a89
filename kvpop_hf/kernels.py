"""What the decode step's Triton kernels share: the optional import, the environment switch between a
kernel and its torch reference."""

from __future__ import annotations

import os

import torch

try:  # kernels are defined at import of their modules, where Triton resolves `tl` as a global
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency; the torch references work without it
    triton = tl = None

MODES = ("auto", "torch", "triton")


def kernel_wanted(env_var: str, device: torch.device) -> bool:
    """True for the Triton kernel: on CUDA unless ``env_var=torch``, anywhere with ``env_var=triton``."""
    mode = os.environ.get(env_var, "auto").lower()
    if mode not in MODES:
        raise ValueError(f"{env_var} must be one of {MODES}, got {mode!r}")
    if mode == "triton" or (mode == "auto" and torch.device(device).type == "cuda"):
        if triton is None:
            raise RuntimeError(f"KVpopCache decoding on CUDA uses Triton kernels: `pip install triton`, or set "
                               f"{env_var}=torch to use the plain torch version.")
        return True
    return False
