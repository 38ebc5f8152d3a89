"""Provenance of result files: the git commit of the tree that produced them and the software versions."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Callable


def _git_dir(start: Path) -> Path | None:
    for d in [start, *start.parents]:
        g = d / ".git"
        if g.is_dir():
            return g
        if g.is_file():  # worktree / submodule: "gitdir: <path>"
            text = g.read_text().strip()
            if text.startswith("gitdir:"):
                p = Path(text.split(":", 1)[1].strip())
                return p if p.is_absolute() else (d / p).resolve()
    return None


def _read_ref(gitdir: Path, ref: str) -> str | None:
    common = gitdir
    if (gitdir / "commondir").is_file():
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    for base in (gitdir, common):
        f = base / ref
        if f.is_file():
            return f.read_text().strip()
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    return None


def git_commit(start: Path | None = None) -> str | None:
    """HEAD commit of the repository holding ``start`` (default: this package): ``$KVPOP_GIT_COMMIT``
    if set (for copies of the tree without ``.git``, e.g. on a remote GPU machine), else read from
    ``.git`` (HEAD, loose ref or packed-refs), falling back to ``git rev-parse HEAD``; None outside a
    repository."""
    if os.environ.get("KVPOP_GIT_COMMIT"):
        return os.environ["KVPOP_GIT_COMMIT"]
    start = Path(start or __file__).resolve()
    try:
        gitdir = _git_dir(start if start.is_dir() else start.parent)
        if gitdir is not None:
            head = (gitdir / "HEAD").read_text().strip()
            sha = _read_ref(gitdir, head[5:].strip()) if head.startswith("ref:") else head
            if sha:
                return sha
    except OSError:
        pass
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=str(start.parent), capture_output=True, text=True,
                             timeout=5)
        return res.stdout.strip() or None if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


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
