"""Run files of the peers runners (pure Python, no kvpop_hf): one JSONL per configuration, one line per problem,
and a ``meta.json``; ``resume`` keeps what a stopped run wrote and skips those problems. ``--shard I/N`` splits the
problems over processes (problem ``i`` to shard ``i % N``), each writing its own folder, and :func:`merge_runs`
joins the folders into one:

    python -m kvpop_lab.peers.runfiles --merge OUT PART [PART ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import IO

__all__ = ["open_run_file", "write_meta", "parse_shard", "shard_rows", "read_run_file", "merge_runs", "done_in",
           "add_run_flags", "check_done_in"]


def read_run_file(path: Path) -> list[str]:
    """The complete lines of a run file (a partial last line, from a run stopped mid-write, is dropped)."""
    lines = []
    for text in path.read_text().splitlines():
        try:
            json.loads(text)
        except json.JSONDecodeError:
            continue
        lines.append(text)
    return lines


def open_run_file(path: Path, resume: bool) -> tuple[IO[str], set[int]]:
    """The file to append a configuration's lines to and the problem indices it already holds (none unless
    ``resume``; a partial last line is dropped)."""
    done: set[int] = set()
    if resume and path.is_file():
        lines = read_run_file(path)
        done = {json.loads(t)["index"] for t in lines}
        path.write_text("".join(t + "\n" for t in lines))
    return open(path, "a" if resume else "w"), done


def add_run_flags(ap: argparse.ArgumentParser) -> None:
    """The flags both runners share: ``--resume``, ``--done-in``, ``--device``, ``--shard`` and ``--device-lock``."""
    ap.add_argument("--resume", action="store_true", help="keep the problems a stopped run wrote and skip them")
    ap.add_argument("--done-in", default=None, metavar="DIR",
                    help="skip the problems an earlier call's merged run folder holds (merge it back in afterwards)")
    ap.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--shard", default=None, metavar="I/N", help="run the problems i with i %% N == I (default: all)")
    ap.add_argument("--device-lock", default=None, metavar="DIR",
                    help="take the device shared for each generation (kvpop_lab.peers.device_lock)")


def check_done_in(folder: str | Path | None) -> None:
    """A ``--done-in`` folder is a run folder (it has a ``meta.json``), else a ValueError naming what to give."""
    if folder is not None and not (Path(folder) / "meta.json").is_file():
        raise ValueError(f"--done-in {folder} holds no meta.json: give the merged run folder of an earlier call "
                         "(raw.tar's kvpress/all or kvpop/all, unpacked)")


def done_in(folder: str | Path | None, name: str) -> set[int]:
    """The problem indices ``folder/name`` holds (an earlier call's merged run folder: ``--done-in``); none when
    ``folder`` is None or has no such file. Its problems are skipped here and joined back in at the merge."""
    check_done_in(folder)
    if folder is None or not (Path(folder) / name).is_file():
        return set()
    return {json.loads(t)["index"] for t in read_run_file(Path(folder) / name)}


def write_meta(out: Path, meta: dict, resume: bool) -> None:
    """``meta.json``: written anew, or on ``resume`` kept with this run's argv, commit and date appended under
    ``resumed``."""
    path = out / "meta.json"
    if resume and path.is_file():
        old = json.loads(path.read_text())
        old.setdefault("resumed", []).append({k: meta.get(k) for k in ("argv", "commit", "date")})
        meta = old
    path.write_text(json.dumps(meta, indent=2) + "\n")


def parse_shard(spec: str | None) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; None -> ``(0, 1)`` (every problem)."""
    if spec is None:
        return 0, 1
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected I/N, e.g. 0/4 (this process runs problems i with i % N == I)") \
            from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec}: I must be in [0, N), got I={i}, N={n}")
    return i, n


def shard_rows(rows: list, shard: tuple[int, int], index=lambda r: r["index"]) -> list:
    """The rows of shard ``(I, N)``: those whose problem index is ``I`` modulo ``N``, in order."""
    i, n = shard
    return [r for r in rows if index(r) % n == i]


def merge_runs(parts: list[Path], out: Path) -> dict[str, int]:
    """Join the run folders of the shards of one run into ``out``: per configuration one file with every shard's
    lines in problem order, and the first shard's ``meta.json`` with every shard's argv under ``shards``. Returns
    ``{configuration: problems}``. A problem in two shards is an error (the shards of two different runs)."""
    parts = [Path(p) for p in parts]
    missing = [str(p) for p in parts if not (p / "meta.json").is_file()]
    if missing:
        raise FileNotFoundError(f"no meta.json in {missing}: not run folders of kvpop_lab.peers.run_kvpress / run_ours")
    lines: dict[str, dict[int, str]] = {}
    for part in parts:
        for f in sorted(part.glob("*.jsonl")):
            mine = lines.setdefault(f.stem, {})
            for text in read_run_file(f):
                index = json.loads(text)["index"]
                if index in mine:
                    raise ValueError(f"problem {index} of {f.stem} is in two shards ({part}): merge the shards of "
                                     "one run only")
                mine[index] = text
    out.mkdir(parents=True, exist_ok=True)
    for stem, by_index in lines.items():
        (out / f"{stem}.jsonl").write_text("".join(by_index[i] + "\n" for i in sorted(by_index)))
    meta = json.loads((parts[0] / "meta.json").read_text())
    meta["shards"] = [json.loads((p / "meta.json").read_text()).get("argv") for p in parts]
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {stem: len(by_index) for stem, by_index in sorted(lines.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Join the run folders of a sharded peers run.")
    ap.add_argument("--merge", required=True, type=Path, metavar="OUT", help="folder to write the joined run to")
    ap.add_argument("parts", nargs="+", type=Path, help="the shards' run folders")
    args = ap.parse_args(argv)
    for stem, n in merge_runs(args.parts, args.merge).items():
        print(f"{stem}: {n} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
