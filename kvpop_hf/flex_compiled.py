"""The compiled FlexAttention shared by the ``kvpop`` attention (inference) and the training passes.

On CUDA ``flex_attention`` runs compiled (eager flex materialises the scores); elsewhere it runs eagerly.
One compiled function per ``(device type, dynamic)``, made on first use:

* training (``dynamic=False``, :data:`TRAINING_DYNAMIC`): a run sees few sequence lengths, so one graph per
  shape gives kernels specialised to it; dynamo's recompile limit is raised so that the shapes x grad modes
  x mask codes never exceed it (past it, torch.compile silently falls back to eager flex);
* inference (torch's default ``dynamic=None``, or ``KVPOP_FLEX_DYNAMIC=1|0``): the candidates of a prompt
  chunk grow with every chunk, so after the first shape torch recompiles once with dynamic shapes instead
  of once per length.
"""

from __future__ import annotations

import functools
import os

import torch

TRAINING_DYNAMIC = False
MIN_RECOMPILE_LIMIT = 64
_DYNAMIC_VALUES = {"1": True, "true": True, "0": False, "false": False}


def raise_recompile_limit(limit: int = MIN_RECOMPILE_LIMIT) -> None:
    """Let dynamo keep at least ``limit`` compiled graphs per code object (and 8x that in total)."""
    try:
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), limit))
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * limit)
    except Exception:  # noqa: BLE001  (config names differ across torch versions)
        pass


def inference_dynamic() -> bool | None:
    """``dynamic`` of the inference flex: ``KVPOP_FLEX_DYNAMIC`` (1/true or 0/false), else torch's default."""
    value = os.environ.get("KVPOP_FLEX_DYNAMIC")
    if value is None:
        return None
    if value.lower() not in _DYNAMIC_VALUES:
        raise ValueError(f"KVPOP_FLEX_DYNAMIC must be 1, true, 0 or false, got {value!r}; unset it for torch's "
                         "default.")
    return _DYNAMIC_VALUES[value.lower()]


@functools.lru_cache(maxsize=None)
def compiled_flex(device_type: str, dynamic: bool | None = None):
    """``flex_attention`` for tensors on ``device_type``: compiled once per ``(device_type, dynamic)`` on CUDA."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled(flex_attention, device_type, dynamic)


@functools.lru_cache(maxsize=None)
def compiled_create_block_mask(device_type: str, dynamic: bool | None = None):
    """``create_block_mask``, compiled like :func:`compiled_flex` (only ``KVPOP_FLEX_BLOCK_MASK=create`` uses it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return _compiled(create_block_mask, device_type, dynamic)


def _compiled(fn, device_type: str, dynamic: bool | None):
    if device_type != "cuda":
        return fn
    if dynamic is False:
        raise_recompile_limit()
    return torch.compile(fn, dynamic=dynamic)
