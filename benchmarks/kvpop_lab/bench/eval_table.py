"""One exact-match table (with binomial standard errors) from several evaluation folders.

    python benchmarks/eval_table.py --out results/testbed_4k/table.md --plot results/testbed_4k/quality_vs_budget.png \\
        --length 4096 results/testbed_4k/eval_learned results/testbed_4k/eval_heuristics ...

A folder's ``results.csv`` (kvpop-eval, benchmarks/oracle_eviction.py) is used when present; otherwise its
``outputs.jsonl`` (kvpop-eval writes it problem by problem, so a run cut by a time limit still has the rows it
finished; token accuracy is then the mean over problems and the fact-lookup accuracy is not available).
A (policy, budget) row seen in an earlier folder wins. ``FOLDER@SUFFIX`` appends SUFFIX to the names of that
folder's policies (not to ``dense``), to list two runs of one policy side by side. EM standard error:
``sqrt(EM (1 - EM) / n)``. Folders holding several families need ``--family``. Where a folder has the
``recall_per_layer.csv`` of ``kvpop-eval --analysis``, the column ``oracle recall`` is the mean of its layers and
heads for that policy and budget (the oracle top-k recall, docs/design.md §6; ``--analysis`` measures it on
reasoning problems, so it is shown for that family only), ``–`` otherwise. ``--exclude PATTERN`` drops the policies
whose name (after its suffix) matches a shell pattern, e.g. the untrained rows that every evaluation folder repeats.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import math
from collections import defaultdict
from pathlib import Path


def _one_family(folder: Path, rows: list[dict], family: str | None) -> list[dict]:
    """The rows of ``family``; with ``family`` None, all rows, which must then be of one family."""
    families = sorted({r.get("family") or "reasoning" for r in rows})
    if family is None:
        if len(families) > 1:
            raise SystemExit(f"{folder} holds several families ({', '.join(families)}): pass --family")
        return rows
    return [r for r in rows if (r.get("family") or "reasoning") == family]


def recall_of(folder: Path) -> dict[tuple[str, str], float]:
    """(policy, budget) -> the mean oracle top-k recall over layers and heads of ``recall_per_layer.csv``."""
    f = folder / "recall_per_layer.csv"
    if not f.is_file():
        return {}
    acc = defaultdict(list)
    for r in csv.DictReader(open(f)):
        acc[(r["policy"], r["budget"])].append(float(r["oracle_recall"]))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def rows_of(folder: Path, family: str | None = None) -> list[dict]:
    recall = recall_of(folder) if (family or "reasoning") == "reasoning" else {}
    if (folder / "results.csv").is_file():
        rows = _one_family(folder, list(csv.DictReader(open(folder / "results.csv"))), family)
        return [{"policy": r["policy"], "budget": r["budget"], "em": float(r["em"]), "n": int(r["n"]),
                 "tok": float(r["token_acc"]), "lookup": r.get("lookup_acc", ""),
                 "recall": recall.get((r["policy"], r["budget"]))} for r in rows]
    if not (folder / "outputs.jsonl").is_file():
        raise SystemExit(f"{folder}: neither results.csv nor outputs.jsonl")
    acc = defaultdict(list)
    for o in _one_family(folder, [json.loads(line) for line in open(folder / "outputs.jsonl")], family):
        acc[(o["policy"], str(o["budget"]))].append(o)
    return [{"policy": p, "budget": b, "em": sum(o["correct"] for o in v) / len(v), "n": len(v),
             "tok": sum(o["token_acc"] for o in v) / len(v), "lookup": "", "recall": recall.get((p, b))}
            for (p, b), v in acc.items()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="evaluation folders, each optionally FOLDER@SUFFIX")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="quality-vs-budget plot (needs --length)")
    ap.add_argument("--length", type=int, default=None, help="problem length in tokens (compression = 1 - B / length)")
    ap.add_argument("--family", default=None, help="the family to tabulate (needed when a folder holds several)")
    ap.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                    help="drop policies whose final name matches this shell pattern (repeatable)")
    args = ap.parse_args(argv)
    if args.plot is not None and (args.length is None or args.length < 1):
        raise SystemExit("--plot needs --length (the problems' length in tokens)")
    seen, table = set(), []
    for spec in args.folders:
        folder, _, suffix = spec.partition("@")
        for r in rows_of(Path(folder), args.family):
            if suffix and r["policy"] != "dense":
                r["policy"] += suffix
            if any(fnmatch.fnmatchcase(r["policy"], pat) for pat in args.exclude):
                continue
            key = (r["policy"], r["budget"])
            if key not in seen:
                seen.add(key)
                table.append(r)
    lines = ["| policy | B | EM | ± SE | n | tok acc | lookup acc | oracle recall |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        se = math.sqrt(r["em"] * (1 - r["em"]) / r["n"]) if r["n"] else math.nan
        lookup = f"{float(r['lookup']):.3f}" if r["lookup"] not in ("", None, "nan") else "–"
        recall = "–" if r.get("recall") is None else f"{r['recall']:.3f}"
        lines.append(f"| {r['policy']} | {r['budget']} | {r['em']:.3f} | {se:.3f} | {r['n']} | {r['tok']:.3f} | "
                     f"{lookup} | {recall} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.plot:
        from kvpop_lab.testbed.report import plot_quality

        plot_quality([{"policy": r["policy"], "budget": r["budget"], "family": args.family or "reasoning", "em": r["em"],
                       "token_acc": r["tok"], "lookup_acc": float(r["lookup"]) if r["lookup"] not in ("", None)
                       else math.nan, "cr": 0.0 if r["budget"] == "full" else 1 - int(r["budget"]) / args.length}
                      for r in table], args.plot)


if __name__ == "__main__":
    main()
