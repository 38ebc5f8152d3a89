"""The rows of the peers speed table (no kvpop_hf; torch only inside :func:`run_stamp`): which (context, batch)
pairs, the budget each holds, what each row records of its run, and the JSONL the three runners append to as each
row finishes (``kvpop_lab.peers.speed_ours`` for KVpop and StaticCache, ``kvpop_lab.peers.speed_kvpress`` for
kvpress, ``kvpop_lab.peers.speed_table`` joins them)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["parse_rows", "budget_entries", "append_row", "read_rows", "FAILED", "check_steps", "run_stamp"]

FAILED = ("OOM", "error")  # what a row's measured fields hold when the call ran out of memory or failed otherwise


def parse_rows(specs: list[str]) -> list[tuple[int, int]]:
    """``["32768x1", "32768x8"]`` -> ``[(32768, 1), (32768, 8)]`` (context x batch), in order, no duplicates."""
    rows = []
    for spec in specs:
        try:
            context, batch = (int(x) for x in spec.lower().split("x"))
        except ValueError:
            raise ValueError(f"row {spec!r}: expected CONTEXTxBATCH, e.g. 32768x1 or 32768x8") from None
        if context < 1 or batch < 1:
            raise ValueError(f"row {spec!r}: context and batch must be >= 1")
        if (context, batch) in rows:
            raise ValueError(f"row {spec!r} is given twice")
        rows.append((context, batch))
    if not rows:
        raise ValueError("no rows: give at least one CONTEXTxBATCH")
    return rows


def budget_entries(compression: float, context: int) -> int:
    """``B = round((1 - compression) * context)`` entries per layer and KV head, as ``kvpop_hf.policies.parse_budgets``
    turns a compression ratio into a budget (both libraries hold this many)."""
    if not 0.0 < compression < 1.0:
        raise ValueError(f"compression {compression} must be in (0, 1)")
    return int(round((1.0 - compression) * context))


def append_row(path: str | Path, row: dict) -> None:
    """One finished row, appended as a JSON line (a run stopped later keeps it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a runner's JSONL (none when it is missing: that runner did not get to write one)."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for text in path.read_text().splitlines():
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:  # a line cut by a killed process
            continue
    return rows


def check_steps(new_tokens: int, warmup: int) -> None:
    """At least three timed decode steps after ``warmup`` untimed ones, else a ValueError naming the fix."""
    if new_tokens < warmup + 3:
        raise ValueError(f"--new-tokens {new_tokens} leaves no timed step after --warmup {warmup}: "
                         f"use --new-tokens >= {warmup + 3}.")


def run_stamp(module: str, argv: list[str] | None, device) -> dict:
    """What every row of a runner records of its run: the device's name, the commit, the date and the command
    (``python -m <module> <argv>``)."""
    import sys
    import time

    import torch

    from kvpop_lab.utils.provenance import git_commit

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "commit": git_commit(Path(__file__)), "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)}
