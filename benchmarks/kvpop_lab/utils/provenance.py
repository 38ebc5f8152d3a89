"""Provenance of result files: the git commit of the tree that produced them and the software versions."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Callable


UNKNOWN = "unknown"


def git_commit(start: Path | str | None = None) -> str:
    """HEAD commit of the git repository holding ``start`` (a file or directory; default: this package).

    ``$KVPOP_GIT_COMMIT`` wins when set (a copy of the tree without ``.git``, e.g. on a remote GPU machine);
    otherwise ``git rev-parse HEAD`` run there. ``"unknown"`` when neither gives one (no git, not a repository)."""
    if os.environ.get("KVPOP_GIT_COMMIT"):
        return os.environ["KVPOP_GIT_COMMIT"]
    where = Path(start or __file__).resolve()
    if not where.is_dir():
        where = where.parent
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git executable, a missing directory, a hung git
        return UNKNOWN
    sha = res.stdout.strip() if res.returncode == 0 else ""
    return sha or UNKNOWN


def _unavailable(err: BaseException) -> str:
    return f"unavailable ({type(err).__name__})"


def versions(*packages: str, missing: Callable[[BaseException], Any] | None = _unavailable) -> dict[str, Any]:
    """``{"python": "3.x.y", package: package.__version__, ...}`` in the order given (the one version dict of
    the benchmarks and result files). A package that fails to import maps to ``missing(error)`` (default
    ``"unavailable (ImportError)"``-style strings), or is left out when ``missing`` is None."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as err:  # noqa: BLE001  (a broken optional install must not stop a benchmark)
            if missing is not None:
                out[name] = missing(err)
    return out
