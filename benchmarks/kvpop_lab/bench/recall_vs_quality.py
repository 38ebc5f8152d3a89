"""Exact match against oracle top-k recall, one point per trained policy: does a scorer that follows its oracle
more closely keep more answers? (KVpop arXiv:2607.05061 reports both, Table 1 and Fig. 7.)

Each point is read from finished runs, nothing is recomputed:

* the exact match at budget ``--budget`` (cache entries ``B``) from a ``kvpop-eval`` folder's ``results.csv``;
* the oracle top-k recall at that budget either from a ``benchmarks/oracle_recall_profile.py`` folder
  (``meta.json`` summary) or from a ``kvpop-eval --analysis`` folder (``recall_per_layer.csv``, averaged over
  layers and heads).

Usage::

    python benchmarks/recall_vs_quality.py --out DIR --budget 492 \\
        --point "max=EVAL_DIR:kvpop_distill@RECALL_DIR:kvpop_max" --point "p2=...:...@...:..."

Writes ``DIR/table.md``, ``DIR/recall_vs_em.png`` and ``DIR/meta.json`` (command, commit, date).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from datetime import date
from pathlib import Path

from kvpop_lab.utils.provenance import git_commit


def parse_point(text: str) -> tuple[str, Path, str, Path, str]:
    """``LABEL=EM_DIR:EM_POLICY@RECALL_DIR:RECALL_POLICY`` -> its five parts (folders must exist)."""
    try:
        label, rest = text.split("=", 1)
        em_part, recall_part = rest.split("@", 1)
        em_dir, em_policy = em_part.rsplit(":", 1)
        recall_dir, recall_policy = recall_part.rsplit(":", 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--point must be LABEL=EM_DIR:EM_POLICY@RECALL_DIR:RECALL_POLICY, got {text!r}") from None
    for d in (em_dir, recall_dir):
        if not Path(d).is_dir():
            raise argparse.ArgumentTypeError(f"--point {text!r}: {d} is not a folder")
    return label, Path(em_dir), em_policy, Path(recall_dir), recall_policy


def exact_match(folder: Path, policy: str, budget: int) -> tuple[float, int]:
    """(EM, number of problems) of ``policy`` at ``budget`` in a kvpop-eval folder."""
    with open(folder / "results.csv") as fh:
        for row in csv.DictReader(fh):
            if row["policy"] == policy and row["budget"] == str(budget):
                return float(row["em"]), int(row["n"])
    raise ValueError(f"{folder}/results.csv has no row for policy {policy!r} at budget {budget}")


def oracle_recall(folder: Path, policy: str, budget: int) -> float:
    """Mean oracle top-k recall of ``policy`` at ``budget``: from a recall profile or a kvpop-eval analysis."""
    if (folder / "recall_per_layer.csv").is_file():
        with open(folder / "recall_per_layer.csv") as fh:
            vals = [float(r["oracle_recall"]) for r in csv.DictReader(fh)
                    if r["policy"] == policy and r["budget"] == str(budget)]
    elif (folder / "meta.json").is_file():
        vals = [float(r["oracle_recall"]) for r in json.loads((folder / "meta.json").read_text()).get("summary", [])
                if r["policy"] == policy and int(r["budget"]) == budget]
    else:
        raise ValueError(f"{folder} holds neither recall_per_layer.csv nor a recall profile's meta.json")
    if not vals:
        raise ValueError(f"{folder} has no oracle recall of policy {policy!r} at budget {budget}")
    return sum(vals) / len(vals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", dest="budget", type=int, required=True, help="B, the cache entries per layer and KV head of the compared rows (one count)")
    ap.add_argument("--point", type=parse_point, action="append", required=True,
                    help="LABEL=EM_DIR:EM_POLICY@RECALL_DIR:RECALL_POLICY (repeatable)")
    ap.add_argument("--recall-line", type=float, default=None, help="draw a reference recall (e.g. the paper's 0.81)")
    args = ap.parse_args(argv)
    rows = []
    for label, em_dir, em_policy, recall_dir, recall_policy in args.point:
        em, n = exact_match(em_dir, em_policy, args.budget)
        rows.append({"label": label, "em": em, "n": n, "oracle_recall": oracle_recall(recall_dir, recall_policy,
                                                                                       args.budget),
                     "em_from": f"{em_dir}:{em_policy}", "recall_from": f"{recall_dir}:{recall_policy}"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/recall_vs_quality.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [f"<!-- {command} -->", f"<!-- commit {git_commit()} | {date.today()} -->", "",
             f"| policy | EM at B = {args.budget} | oracle top-k recall | EM from | recall from |", "|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['em']:.3f} (n = {r['n']}) | {r['oracle_recall']:.3f} | `{r['em_from']}` | "
              f"`{r['recall_from']}` |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "meta.json").write_text(json.dumps({"command": command, "commit": git_commit(), "date": str(date.today()),
                                               "budget": args.budget, "rows": rows}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    se = [(r["em"] * (1 - r["em"]) / max(1, r["n"])) ** 0.5 for r in rows]  # binomial standard error of the EM
    ax.errorbar([r["oracle_recall"] for r in rows], [r["em"] for r in rows], yerr=se, fmt="o", capsize=3)
    if args.recall_line is not None:
        ax.axvline(args.recall_line, ls="--", color="grey", lw=1)
        ax.annotate(f"recall {args.recall_line:g}", (args.recall_line, min(r["em"] for r in rows)),
                    textcoords="offset points", xytext=(-4, 0), ha="right", fontsize=8, color="grey")
    for r in rows:
        ax.annotate(r["label"], (r["oracle_recall"], r["em"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("oracle top-k recall")
    ax.set_ylabel(f"exact match at B = {args.budget} (± binomial SE)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "recall_vs_em.png", dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
