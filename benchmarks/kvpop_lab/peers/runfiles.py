"""Run files of the peers runners (pure Python, no kvpop_hf): one JSONL per configuration, one line per problem,
and a ``meta.json``; ``resume`` keeps what a stopped run wrote and skips those problems."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

__all__ = ["open_run_file", "write_meta"]


def open_run_file(path: Path, resume: bool) -> tuple[IO[str], set[int]]:
    """The file to append a configuration's lines to and the problem indices it already holds (none unless
    ``resume``; a partial last line, from a run stopped mid-write, is dropped)."""
    done: set[int] = set()
    if resume and path.is_file():
        lines = []
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            lines.append(text)
            done.add(line["index"])
        path.write_text("".join(t + "\n" for t in lines))
    return open(path, "a" if resume else "w"), done


def write_meta(out: Path, meta: dict, resume: bool) -> None:
    """``meta.json``: written anew, or on ``resume`` kept with this run's argv, commit and date appended under
    ``resumed``."""
    path = out / "meta.json"
    if resume and path.is_file():
        old = json.loads(path.read_text())
        old.setdefault("resumed", []).append({k: meta.get(k) for k in ("argv", "commit", "date")})
        meta = old
    path.write_text(json.dumps(meta, indent=2) + "\n")
