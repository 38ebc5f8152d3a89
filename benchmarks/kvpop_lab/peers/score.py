"""Score the peers runs with this repository's exact match and write the quality table with its provenance.

    python -m kvpop_lab.peers.score --problems /work/peers/data/record_4k.jsonl \\
        --kvpress /work/peers/out/kvpress --kvpop /work/peers/out/kvpop --out results/peers/quality_4k.csv

kvpress rows (token ids from ``kvpop_lab.peers.run_kvpress``) are decoded with the teacher's tokenizer and scored by
``kvpop_lab.peers.problems.score_ids`` (kvpop-eval's row rule); KVpop rows carry kvpop-eval's own verdict
(``kvpop_lab.peers.run_ours``). Only the problems every run finished count (the first ``n`` of the file), so an interrupted
run still gives one table on one set of problems. EM with its binomial standard error ``sqrt(p (1 - p) / n)``;
``trace_prefix``: the mean share of the reference trace reproduced before the first wrong word
(``kvpop_lab.peers.problems.prefix_share``), finer than EM where a policy loses most answers; ``answered``: the share of
outputs that reach ``answer :`` at all (the answer is one digit, so a well-formed trace with wrong lookups still
answers right about one time in ten).
Commit and date come from each run folder's ``meta.json`` (``--kvpress-commit`` / ``--kvpop-commit`` for a
folder without them).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from kvpop_lab.peers.mapping import decoding_interval

LIBRARIES = {"kvpress": "kvpress 0.5.5", "kvpop": "kvpop-hf"}
COLUMNS = ["library", "policy", "mode", "compression", "B", "entries_end", "n", "em", "se", "trace_prefix", "answered", "command",
           "commit", "date"]
ANSWER = "answer :"  # the marker before a reasoning trace's answer (kvpop_lab.testbed.tokenizer.ANSWER_MARKER)
EXPORT = "python -m kvpop_lab.peers.export --out P"


def em_se(hits: list[bool]) -> tuple[float, float]:
    """Exact match and its binomial standard error over ``hits``."""
    if not hits:
        raise ValueError("no problems to score: every run must finish at least its first problem")
    p = sum(hits) / len(hits)
    return p, math.sqrt(p * (1 - p) / len(hits))


def load_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """``{file stem: {problem index: line}}`` of every ``*.jsonl`` in a run folder."""
    runs = {}
    for f in sorted(folder.glob("*.jsonl")):
        runs[f.stem] = {r["index"]: r for r in (json.loads(x) for x in f.read_text().splitlines() if x.strip())}
    if not runs:
        raise FileNotFoundError(f"{folder} holds no run files (*.jsonl): run kvpop_lab.peers.run_kvpress / kvpop_lab.peers.run_ours first")
    return runs


def common_prefix(runs: list[dict[int, dict]]) -> int:
    """The number of leading problem indices 0, 1, ... that every run holds."""
    n = 0
    while all(n in r for r in runs):
        n += 1
    return n


def is_variant(stem: str) -> bool:
    """A KVpop run with another window than the record's (``kvpop_lab.peers.run_ours --window``: ``<policy>_cr<NN>_w<W>...``);
    it counts its own first problems, the others count the problems all of them finished."""
    return "_w" in stem


def mode_label(library: str, stem: str, line: dict) -> str:
    """How the budget is held: ``full`` (dense), ``fixed B`` (KVpop), kvpress ``prefill`` or
    ``prefill + decoding every N``."""
    if stem == "dense":
        return "full"
    if library == "kvpop":
        window = line.get("window", 64)
        obs = line.get("obs_window")
        return "fixed B" if window == 64 else f"fixed B, window {window}" + (f", {obs} voting queries" if obs else "")
    if line["mode"] == "prefill":
        return "prefill"
    return f"prefill + decoding every {decoding_interval(line['press'])}"


def provenance(folder: Path, commit: str | None) -> tuple[str, str]:
    """``(commit, date)`` of a run folder from its ``meta.json``: the first run's commit (or ``commit``), with the
    commits of ``--resume`` runs after it, and the first run's date."""
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    commit = commit or meta.get("commit")
    if not commit:
        raise ValueError(f"{meta_path} names no commit: pass the commit the run ran at (--kvpress-commit / "
                         "--kvpop-commit)")
    later = []
    for run in meta.get("resumed", []):
        c = (run.get("commit") or "unknown")[:7]
        if c != commit[:7] and c not in later:
            later.append(c)
    text = commit[:7] + (f" (resumed at {', '.join(later)})" if later else "")
    date = meta.get("date")
    if not date:
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} not found: the runners write it; a run folder needs it for the date")
        import time

        date = time.strftime("%Y-%m-%d", time.gmtime(meta_path.stat().st_mtime))
    return text, date


def table(problems: list[dict], folders: dict[str, Path], commands: dict[str, str], commits: dict[str, str | None],
          tokenizer) -> tuple[list[dict], int, dict]:
    """The rows of the quality table, the number of problems they share, and per row (same order) the
    per-problem ``(hits, prefix shares)``."""
    from kvpop_lab.peers.problems import prefix_share, score_ids

    runs = {lib: load_runs(folder) for lib, folder in folders.items()}
    main = [r for lib in runs.values() for stem, r in lib.items() if not is_variant(stem)]
    n = min(common_prefix(main), len(problems))
    if n == 0:
        raise ValueError("no problem is finished by every run: nothing to compare")
    rows, per_problem = [], {}
    for lib, lib_runs in runs.items():
        commit, date = provenance(folders[lib], commits.get(lib))
        for stem, lines in lib_runs.items():
            hits, entries, prefix, answered = [], [], [], []
            n_run = min(n, common_prefix([lines])) if is_variant(stem) else n
            if n_run == 0:
                continue
            for i in range(n_run):
                line, prob = lines[i], problems[i]
                if line["seed"] != prob["seed"]:
                    raise ValueError(f"{folders[lib]}/{stem}.jsonl problem {i} has seed {line['seed']}, the problem "
                                     f"file {prob['seed']}: they come from different exports")
                if lib == "kvpress":
                    scored = score_ids(tokenizer, line["generated_ids"], prob["answer"])
                    hits.append(scored["correct"])
                    prefix.append(prefix_share(scored["generated"], prob["target"]))
                    answered.append(ANSWER in scored["generated"])
                    entries.append(line["entries_end"])
                else:
                    hits.append(bool(line["correct"]))
                    prefix.append(prefix_share(line["generated"], prob["target"]))
                    answered.append(ANSWER in line["generated"])
            em, se = em_se(hits)
            first = lines[0]
            comp = first.get("compression")
            policy = first.get("press") or first.get("policy")
            rows.append({"library": LIBRARIES[lib], "policy": policy, "mode": mode_label(lib, stem, first),
                         "compression": "" if comp is None else f"{round(100 * float(comp))}%",
                         "B": "" if comp is None else first["B"],
                         "entries_end": max(entries) if entries else ("" if comp is None else first["B"]),
                         "n": n_run, "em": f"{em:.3f}", "se": f"{se:.3f}",
                         "trace_prefix": f"{sum(prefix) / n_run:.3f}", "answered": f"{sum(answered) / n_run:.3f}",
                         "command": commands[lib], "commit": commit,
                         "date": date})
            per_problem[id(rows[-1])] = (hits, prefix)
    order = {"dense": 0, "streaming": 1, "knorm": 2, "keydiff": 3, "snapkv": 4, "tova": 5}
    rows.sort(key=lambda r: (order.get(r["policy"], 9), r["compression"], r["library"] != "kvpop-hf", r["mode"]))
    return rows, n, [per_problem[id(r)] for r in rows]


def compare(rows: list[dict], per_problem: list) -> list[dict]:
    """Each other row against KVpop's row (window 64) of the same policy and compression: the EM difference in units of
    its standard error ``sqrt(se1^2 + se2^2)`` and the paired difference of the trace prefix (mean +- SE)."""
    ours = {(r["policy"], r["compression"]): i for i, r in enumerate(rows)
            if r["library"] == "kvpop-hf" and r["mode"] == "fixed B"}
    out = []
    for i, r in enumerate(rows):  # kvpress rows and KVpop's other variants, each against KVpop's row
        j = ours.get((r["policy"], r["compression"]))
        if j is None or i == j:
            continue
        m = min(len(per_problem[i][0]), len(per_problem[j][0]))  # a variant may have fewer problems
        (h1, p1), (h0, p0) = [(h[:m], p[:m]) for h, p in (per_problem[i], per_problem[j])]
        em1, se1 = em_se(h1)
        em0, se0 = em_se(h0)
        se = math.sqrt(se1 ** 2 + se0 ** 2)
        d = [a - b for a, b in zip(p1, p0)]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else float("nan")
        out.append({"policy": r["policy"], "compression": r["compression"], "library": r["library"], "mode": r["mode"],
                    "EM kvpop": f"{em0:.3f}", "EM other": f"{em1:.3f}",
                    "EM diff / SE": "0" if se == 0 and em1 == em0 else f"{(em1 - em0) / se:+.1f}" if se else "inf",
                    "prefix kvpop": f"{sum(p0) / len(p0):.3f}", "prefix other": f"{sum(p1) / len(p1):.3f}",
                    "prefix diff": f"{mean:+.3f} ± {sd / math.sqrt(len(d)):.3f}"})
    return out


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", required=True)
    ap.add_argument("--kvpress", required=True, type=Path, help="run folder of kvpop_lab.peers.run_kvpress")
    ap.add_argument("--kvpop", required=True, type=Path, help="run folder of kvpop_lab.peers.run_ours")
    ap.add_argument("--out", required=True, type=Path, help="CSV to write")
    ap.add_argument("--tokenizer", default="checkpoints/testbed-4k-teacher")
    ap.add_argument("--compare", type=Path, default=None,
                    help="also write the kvpress-vs-KVpop comparison of each policy as a markdown table here")
    ap.add_argument("--kvpress-commit", default=None)
    ap.add_argument("--kvpop-commit", default=None)
    ap.add_argument("--kvpress-command", default="OMP_NUM_THREADS=1 PYTHONPATH=benchmarks <kvpress venv>/bin/python "
                    "-m kvpop_lab.peers.run_kvpress --problems P --out K")
    ap.add_argument("--kvpop-command", default="OMP_NUM_THREADS=1 python -m kvpop_lab.peers.run_ours "
                    "--problems P --out O")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from kvpop_lab.peers.problems import read_jsonl

    problems = read_jsonl(args.problems)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    score = "python -m kvpop_lab.peers.score --problems P --kvpress K --kvpop O --out CSV"
    commands = {"kvpress": f"{EXPORT}; {args.kvpress_command}; {score}",
                "kvpop": f"{EXPORT}; {args.kvpop_command}; {score}"}
    rows, n, per_problem = table(problems, {"kvpress": args.kvpress, "kvpop": args.kvpop}, commands,
                    {"kvpress": args.kvpress_commit, "kvpop": args.kvpop_commit}, tok)
    write_csv(rows, args.out)
    if args.compare:
        args.compare.parent.mkdir(parents=True, exist_ok=True)
        args.compare.write_text(markdown(compare(rows, per_problem)))
    for r in rows:
        print(f"{r['library']:14s} {r['policy']:9s} {r['compression']:4s} {r['mode']:30s} "
              f"EM {r['em']} ± {r['se']}  prefix {r['trace_prefix']}  entries {r['entries_end']}")
    print(f"{n} problems; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
