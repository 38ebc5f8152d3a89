"""``kvpop-lm-eval-table``: several lm-eval result folders (one run per policy and budget) -> the policy x
compression table (markdown and CSV) and plot that ``kvpop-eval`` writes for the testbed.

    kvpop-lm-eval-table runs/dense runs/snapkv_cr88 runs/kvpop_cr88 --out table/ [--metric exact_match] [--length 4096]

Each folder is an lm-eval ``--output_path`` (its ``results_*.json`` are found at any depth; the newest per folder
is read). A run's policy and budget come from what the ``kvpop`` model records beside the results (``policy``,
``sinks``, ``window``, ``topk`` or ``compression``, a checkpoint's own budget filled in), else its ``model_args``;
a ``--model hf`` run (or ``policy=dense``) is the dense reference. The compression ratio is ``compression`` when
given, else ``1 - B / --length`` (``B = sinks + window + topk``), else unknown (then the plot's x axis is B).
Columns are the tasks (groups left out) with the metric under any filter (``exact_match,rollouts``,
``exact_match,none``, ...). "vs dense" compares each run with the dense run over the tasks both have; runs whose
task sets differ are marked ``*``, with a note naming the tasks left out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["read_run", "collect_rows", "markdown_table", "plot_table", "main"]

CSV_COLUMNS = ["policy", "budget", "cr", "sinks", "window", "topk", "compression", "task", "metric", "value", "n",
               "source"]


def _model_args(cfg: dict) -> dict:
    args = cfg.get("model_args") or {}
    if isinstance(args, str):  # "k=v,k=v" as lm-eval records a string argument
        out = {}
        for part in args.split(","):
            if "=" in part:
                k, v = part.split("=", 1)
                out[k.strip()] = v.strip()
        return out
    return dict(args)


def read_run(folder: str | Path) -> dict:
    """The newest ``results_*.json`` under ``folder``, as a dict (its path under ``"_path"``)."""
    files = sorted(Path(folder).rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise ValueError(f"{folder}: no lm-eval results_*.json found (pass the --output_path of a run).")
    data = json.loads(files[-1].read_text())
    data["_path"] = str(files[-1])
    return data


def _num(x):
    if x in (None, ""):
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return int(f) if f.is_integer() else f


def collect_rows(folders: Sequence[str | Path], metric: str = "exact_match", length: int | None = None) -> list[dict]:
    """One row per (run, task): policy, budget ``B`` ("full" for dense), ``cr``, the metric value and ``n``."""
    rows = []
    for folder in folders:
        run = read_run(folder)
        cfg = run.get("config", {})
        # the resolved settings the kvpop model records (checkpoint defaults filled in), else its model_args
        args = cfg.get("kvpop") or _model_args(cfg)
        policy = str(args.get("policy") or "kvpop") if cfg.get("model") == "kvpop" else "dense"
        s, w, k, cr_arg = (_num(args.get(n)) for n in ("sinks", "window", "topk", "compression"))
        if policy == "dense":
            budget, cr = "full", 0.0
        elif cr_arg is not None:
            budget, cr = f"cr{round(100 * cr_arg)}", float(cr_arg)
        elif None not in (s, w, k):
            budget = s + w + k
            cr = max(0.0, 1.0 - budget / length) if length else float("nan")
        else:  # the checkpoint's own budget (learned policies without sinks/window/topk)
            budget, cr = "checkpoint", float("nan")
        groups = set(run.get("group_subtasks", {}))
        for task, res in run.get("results", {}).items():
            if task in groups:
                continue
            keys = [key for key in res if key.split(",")[0] == metric]
            if not keys:
                continue
            rows.append({"policy": policy, "budget": budget, "cr": cr, "sinks": s, "window": w, "topk": k,
                         "compression": cr_arg, "task": task, "metric": metric, "value": float(res[keys[0]]),
                         "n": (run.get("n-samples", {}).get(task) or {}).get("effective"),
                         "source": run["_path"]})
    if not rows:
        raise ValueError(f"no task in {list(map(str, folders))} reports the metric {metric!r}.")
    return rows


def _table(rows: Sequence[dict]) -> tuple[list[str], dict]:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    runs: dict[tuple, dict] = {}
    for r in rows:
        d = runs.setdefault((r["policy"], str(r["budget"])), {"cr": r["cr"], "v": {}})
        d["v"][r["task"]] = r["value"]
    for d in runs.values():
        vals = [d["v"][t] for t in tasks if t in d["v"]]
        d["avg"] = sum(vals) / len(vals) if vals else float("nan")
    return tasks, runs


def _f(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def markdown_table(rows: Sequence[dict], title: str = "lm-eval: quality vs KV budget") -> str:
    """One line per (policy, budget): the metric per task, the average and the average relative to dense. "vs dense"
    compares a run with the dense run over the tasks both have; a run that lacks some of the table's tasks, or
    whose comparison with dense leaves tasks out, is marked ``*`` and a note under the table names those tasks."""
    tasks, runs = _table(rows)
    dense = next((d["v"] for (p, b), d in runs.items() if b == "full"), None)
    metric = rows[0]["metric"]
    head = ["policy", "B", "cr"] + tasks + [f"{metric} avg", "vs dense"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(runs.items(), key=lambda kv: (kv[0][1] != "full", kv[0][0], -1 if math.isnan(kv[1]["cr"]) else
                                                 kv[1]["cr"]))
    notes = []
    for (p, b), d in order:
        common = [t for t in tasks if t in d["v"] and dense is not None and t in dense]
        ref = _mean(dense[t] for t in common) if dense is not None else float("nan")
        mine = _mean(d["v"][t] for t in common)
        rel = "n/a" if not common or not ref or math.isnan(mine) else f"{100 * mine / ref:.1f}%"
        missing = [t for t in tasks if t not in d["v"]]
        left_out = [t for t in d["v"] if dense is not None and t not in dense]
        mark = ""
        if missing or (dense is not None and left_out):
            mark = "*"
            what = [f"no result for {', '.join(missing)} (avg over its {len(d['v'])} task(s))"] if missing else []
            if dense is not None:
                what.append(f"vs dense over the {len(common)} task(s) both have" if common else
                            "no task in common with dense (vs dense n/a)")
            notes.append(f"* {p} {b}: " + "; ".join(what) + ".")
        lines.append("| " + " | ".join([p, b, _f(d["cr"])] + [_f(d["v"].get(t)) for t in tasks]
                                       + [_f(d["avg"]) + mark, rel + (mark if rel != "n/a" else "")]) + " |")
    lines += ["", f"{metric} per lm-eval task; avg: unweighted mean over the tasks; vs dense: the mean over the tasks "
                  "the run and the dense run both have, relative to dense's mean over the same tasks; B = sinks + "
                  "window + topk per layer and KV head (crNN: compression=0.NN of each request's context).", ""]
    if notes:
        lines += ["Runs over different task sets:", "", *notes, ""]
    return "\n".join(lines)


def plot_table(rows: Sequence[dict], path: Path) -> None:
    """The average metric vs compression ratio (or B where a ratio is unknown), one line per policy."""
    from ..plotting import line_styles, pyplot

    plt = pyplot(path)  # None without matplotlib: a printed note, the tables are written anyway
    if plt is None:
        return

    tasks, runs = _table(rows)
    use_cr = all(not math.isnan(d["cr"]) for d in runs.values())
    fig, ax = plt.subplots(figsize=(6, 4))
    by: dict[str, list] = {}
    for (p, b), d in runs.items():
        if b == "full":
            ax.axhline(d["avg"], ls="--", color="k", lw=1, label=f"{p} (full cache)")
            continue
        x = d["cr"] if use_cr else (float(b) if b.isdigit() else float("nan"))
        by.setdefault(p, []).append((x, d["avg"]))
    styles = line_styles(sorted(by))
    for p, pts in sorted(by.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, **styles[p])
    ax.set_xlabel("compression ratio" if use_cr else "B (entries per layer and KV head)")
    ax.set_ylabel(f"avg {rows[0]['metric']} over {len(tasks)} tasks")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import csv

    import shlex
    from datetime import datetime, timezone

    from importlib.metadata import version

    ap = argparse.ArgumentParser(prog="kvpop-lm-eval-table", description=__doc__.replace("``", "`"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="lm-eval --output_path folders, one per policy and budget")
    ap.add_argument("--out", required=True, help="folder for table.md, table.csv and quality_vs_budget.png")
    ap.add_argument("--metric", default="exact_match", help="metric name as the tasks report it")
    ap.add_argument("--length", type=int, default=None,
                    help="context length for cr = 1 - B / length of runs given with topk= (kvpop-eval's convention)")
    ap.add_argument("--no-plot", action="store_true", help="write table.md and table.csv only")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    rows = collect_rows(args.runs, args.metric, args.length)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    header = (f"`kvpop-lm-eval-table {shlex.join(argv)}` (kvpop-hf {version('kvpop-hf')}, "
              f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})\n\n")
    md = markdown_table(rows)
    (out / "table.md").write_text(header + md)
    if not args.no_plot:
        plot_table(rows, out / "quality_vs_budget.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
