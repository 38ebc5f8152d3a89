"""Merge the ``results.csv`` of several ``kvpop-eval`` runs (e.g. one run per budget range) into one
table and one quality-vs-budget plot.

    python benchmarks/merge_eval_runs.py --out results/eval_testbed_budgets_cpu \\
        results/eval_testbed_cpu results/eval_testbed_budgets_cpu

Rows are keyed by (policy, budget, family); a key seen in an earlier run wins (the dense rows of later
runs repeat it). The runs must use the same model, problems and families (their ``meta.json`` are compared:
model, length, problems per family, seeds, families, knobs); otherwise the merge stops with an error naming the difference.
Writes ``merged_results.csv``, ``merged_table.md`` and ``merged_quality_vs_budget.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from kvpop_lab.testbed.report import plot_quality, quality_table, write_results_csv

SAME = ("model", "length", "n_per_family", "seeds", "families", "knobs")
FLOATS = ("cr", "em", "token_acc", "lookup_acc")


def _meta(run: Path) -> dict:
    meta = json.loads((run / "meta.json").read_text())
    return {k: meta.get(k) for k in SAME}


def _row(r: dict) -> dict:
    out = dict(r)
    for k in FLOATS:
        out[k] = float(r[k]) if r.get(k) not in (None, "") else math.nan
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Merged kvpop-eval runs")
    ap.add_argument("runs", nargs="+", help="kvpop-eval output folders (results.csv + meta.json)")
    args = ap.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    for r in runs:
        if not (r / "results.csv").is_file() or not (r / "meta.json").is_file():
            raise SystemExit(f"{r}: not a kvpop-eval output folder (needs results.csv and meta.json)")
    ref = _meta(runs[0])
    for r in runs[1:]:
        m = _meta(r)
        diff = [k for k in SAME if m[k] != ref[k]]
        if diff:
            raise SystemExit(f"{r} differs from {runs[0]} in {diff}: {[m[k] for k in diff]} vs "
                             f"{[ref[k] for k in diff]}; only runs on the same problems can be merged")
    rows, seen = [], set()
    for r in runs:
        with open(r / "results.csv", newline="") as fh:
            for row in csv.DictReader(fh):
                key = (row["policy"], row["budget"], row["family"])
                if key not in seen:
                    seen.add(key)
                    rows.append(_row(row))
    rows.sort(key=lambda x: (x["budget"] != "full", x["policy"], x["cr"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results_csv(rows, out / "merged_results.csv")
    fams = sorted({r["family"] for r in rows})
    sources = ", ".join(f"`{r}`" for r in runs)
    (out / "merged_table.md").write_text(quality_table(rows, fams, args.title) + f"\nMerged from {sources}.\n")
    plot_quality(rows, out / "merged_quality_vs_budget.png")
    print(quality_table(rows, fams, args.title))
    print("wrote", out)


if __name__ == "__main__":
    main()
