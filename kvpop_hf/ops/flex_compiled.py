"""The compiled FlexAttention shared by the ``kvpop`` attention (inference) and the training passes.

On CUDA ``flex_attention`` runs compiled (eager flex materialises the scores); elsewhere it runs eagerly.
One compiled function per ``(device type, dynamic)``, made on first use:

* training (``dynamic=False``, :data:`TRAINING_DYNAMIC`): a run sees few sequence lengths, so one graph per
  shape gives kernels specialised to it; dynamo's recompile limit is raised, for these calls only
  (``torch._dynamo.config.patch`` around each call, the global config is left alone), so that the shapes x
  grad modes x mask codes never exceed it (past it, torch.compile silently falls back to eager flex);
* inference (``dynamic=True``, :data:`INFERENCE_DYNAMIC`): the candidates of a prompt chunk grow with every chunk
  and prompts differ in length, so the first chunk compiles the dynamic-shape graph every later chunk and prompt
  reuses (torch's default, ``dynamic=None``, would compile a static graph for the first shape and recompile at the
  second: two compilations in a process's first prompt).
"""

from __future__ import annotations

import functools

import torch

TRAINING_DYNAMIC = False
INFERENCE_DYNAMIC = True
MIN_RECOMPILE_LIMIT = 64


def recompile_limits(limit: int = MIN_RECOMPILE_LIMIT) -> dict:
    """``torch._dynamo.config`` settings that let dynamo keep at least ``limit`` compiled graphs per code object
    (and 8x that in total), for ``torch._dynamo.config.patch(**...)``; only the names this torch has (older ones
    call them ``cache_size_limit``)."""
    cfg = torch._dynamo.config
    wanted = {"recompile_limit": limit, "cache_size_limit": limit, "accumulated_recompile_limit": 8 * limit,
              "accumulated_cache_size_limit": 8 * limit}
    return {name: max(getattr(cfg, name), value) for name, value in wanted.items() if hasattr(cfg, name)}


@functools.lru_cache(maxsize=None)
def compiled_flex(device_type: str, dynamic: bool | None = None):
    """``flex_attention`` for tensors on ``device_type``: compiled once per ``(device_type, dynamic)`` on CUDA."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled(flex_attention, device_type, dynamic)


@functools.lru_cache(maxsize=None)
def compiled_create_block_mask(device_type: str, dynamic: bool | None = None):
    """``create_block_mask``, compiled like :func:`compiled_flex` (only the private variant
    ``Backends(_flex_block_mask="create")`` uses it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return _compiled(create_block_mask, device_type, dynamic)


def _compiled(fn, device_type: str, dynamic: bool | None):
    if device_type != "cuda":
        return fn
    compiled = torch.compile(fn, dynamic=dynamic)
    if dynamic is not False:
        return compiled

    @functools.wraps(fn)
    def with_recompile_limit(*args, **kwargs):
        """The compiled function under a raised recompile limit, for this call only (dynamo checks the limit
        when the call looks up its graphs). Inside an outer compiled region the call is traced inline."""
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        with torch._dynamo.config.patch(**recompile_limits()):
            return compiled(*args, **kwargs)

    return with_recompile_limit
