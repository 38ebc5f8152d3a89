"""Compiled decode steps reused across processes: one directory of torch's compile caches per machine.

``generate`` compiles the decode step of a compileable cache (``KVpopCache``, ``StaticCache``) on CUDA in every
new process. Most of that time is inductor's code generation and Triton's kernel compilation and autotuning,
which torch caches on disk (FX graph cache, AOT-autograd cache, Triton cache, autotuning results) under a
per-user temporary directory by default. :func:`enable_compile_cache` points those caches at a directory of
your choice (kept across restarts, shared by the processes of a machine) and hot-loads the portable bundle that
:func:`save_compile_cache` wrote there (``torch.compiler.save_cache_artifacts``: the same artifacts as bytes, for
a fresh machine or a container image). Dynamo's tracing of the model still runs in every process.

Warm a deployment once (docs/usage.md, "Compile once per machine")::

    enable_compile_cache("/var/cache/kvpop")      # before the first compiled call
    model.generate(...)                           # compiles and fills the caches
    save_compile_cache("/var/cache/kvpop")        # the portable bundle

and start every serving process with ``enable_compile_cache("/var/cache/kvpop")``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["ARTIFACTS_FILE", "enable_compile_cache", "save_compile_cache"]

ARTIFACTS_FILE = "torch_compile_artifacts.bin"


def enable_compile_cache(directory: str | os.PathLike) -> dict:
    """Use ``directory`` for torch's on-disk compile caches in this process and load its saved bundle, if any.

    Sets ``TORCHINDUCTOR_CACHE_DIR`` (``<directory>/inductor``) and ``TRITON_CACHE_DIR`` (``<directory>/triton``)
    and turns on the FX-graph and AOT-autograd caches. Call it before the first compiled call of the process:
    graphs compiled earlier were already looked up elsewhere. Returns what was done: ``{"directory",
    "loaded": the artifact count of the bundle or 0}``."""
    root = Path(directory).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise ValueError(f"compile cache {str(root)!r} is a file, not a directory: give a directory path.")
    (root / "inductor").mkdir(parents=True, exist_ok=True)
    (root / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    loaded = 0
    bundle = root / ARTIFACTS_FILE
    if bundle.is_file():
        info = torch.compiler.load_cache_artifacts(bundle.read_bytes())
        loaded = _count(info)
    return {"directory": str(root), "loaded": loaded}


def save_compile_cache(directory: str | os.PathLike) -> Path | None:
    """Write the artifacts compiled so far in this process to ``<directory>/torch_compile_artifacts.bin`` (the
    portable bundle :func:`enable_compile_cache` loads). None when nothing was compiled."""
    root = Path(directory).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    data, _info = saved
    path = root / ARTIFACTS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a reader never sees half a bundle
    return path


def _count(info) -> int:
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(v) for v in artifacts.values())
