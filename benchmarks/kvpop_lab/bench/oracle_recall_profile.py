"""Where a scorer's oracle top-k recall is lost: recall of the oracle's best m tokens, for several m, and the
share of the oracle's kept attention (KVpop arXiv:2607.05061, Fig. 7's metric taken apart).

The oracle top-k recall of ``kvpop-eval --analysis`` counts every one of the ``k`` tokens the oracle keeps. On
problems where a few tokens carry the answer, most of those ``k`` are tokens the future barely attends to, and
their order is close to arbitrary. This script reports, per policy and budget (means over layers, KV heads and
problems; :func:`kvpop_lab.testbed.analysis.oracle_topk_recall`):

* ``oracle_recall``: the usual recall of the oracle's top-k;
* ``oracle_recall_top<m>``: the share of the oracle's best ``m`` eligible tokens (at each query) that the
  policy keeps within its ``k``;
* ``oracle_mass``: the oracle's kept tokens weighted by their future attention: the share of that attention the
  policy's kept set holds.

Usage (the 4k testbed, the committed distilled student and scorers; CPU, ~2 min a problem):
    python benchmarks/oracle_recall_profile.py --model checkpoints/testbed-4k-teacher --out results/recall_profile_4k \\
        --length 4096 --n 4 --window 64 --compression 0.88 --knob reasoning.n_facts=10 --knob reasoning.steps=4 \\
        --student kvpop_distill=checkpoints/testbed-4k-kvpop-cr88 --baselines streaming \\
        --oracle-ks 16,32,64,128
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import time

import torch

from kvpop_lab.utils.provenance import git_commit
from kvpop_lab.testbed.oracle import oracle_kind_arg
from kvpop_lab.testbed.static_policies import add_benchmark_args, benchmark_setup, check_policy_args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_benchmark_args(ap)
    ap.add_argument("--oracle-ks", default="16,32,64,128", help="the m of oracle_recall_top<m>")
    ap.add_argument("--oracle-kind", type=oracle_kind_arg, default="max",
                    help="max, mean or p<x> (power mean of order x > 1, e.g. p4) future attention")
    ap.add_argument("--oracle-queries", choices=("target", "all"), default="target")
    ap.add_argument("--oracle-decay", action="store_true",
                    help="rank the oracle with each policy's own recency decay too (--log-gammas; the paper's "
                         "Eq. 5 applies it to teacher and student); the oracle_mass column is then left out")
    args = ap.parse_args(argv)
    check_policy_args(ap, args)
    try:
        args.oracle_ks = [int(m) for m in args.oracle_ks.split(",") if m]
    except ValueError:
        ap.error(f"--oracle-ks takes integers like 16,32,64, got {args.oracle_ks!r}")
    if any(m < 1 for m in args.oracle_ks):
        ap.error("--oracle-ks must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    from kvpop_lab.testbed.analysis import oracle_recall_rows

    model, tok, problems, scored = benchmark_setup(args)
    dev = torch.device(args.device)
    t0 = time.time()
    rows = oracle_recall_rows(model, tok, problems, scored, kind=args.oracle_kind, queries=args.oracle_queries,
                              oracle_ks=args.oracle_ks, mass=not args.oracle_decay, oracle_decay=args.oracle_decay)
    metrics = (["oracle_recall"] + [f"oracle_recall_top{m}" for m in args.oracle_ks]
               + ([] if args.oracle_decay else ["oracle_mass"]))
    summary = []
    for (policy, B, cr) in dict.fromkeys((r["policy"], r["budget"], r["cr"]) for r in rows):
        sel = [r for r in rows if (r["policy"], r["budget"], r["cr"]) == (policy, B, cr)]
        summary.append({"policy": policy, "budget": B, "cr": cr, "topk": B - args.sinks - args.window,
                        **{m: torch.tensor([r[m] for r in sel]).nanmean().item() for m in metrics}})
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "recall_per_head.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    command = "python benchmarks/oracle_recall_profile.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [f"<!-- {command} -->", f"<!-- commit {git_commit()} | {time.strftime('%Y-%m-%d')} | device {dev} | "
             f"{args.n} problems, oracle {args.oracle_kind} of {args.oracle_queries} queries"
             f"{', each policy decay on the oracle too' if args.oracle_decay else ''}, "
             f"{time.time() - t0:.0f} s -->",
             "", "| policy | B | cr | " + " | ".join(metrics) + " |", "|---" * (3 + len(metrics)) + "|"]
    for s in summary:
        lines.append(f"| {s['policy']} | {s['budget']} | {s['cr']:.2f} | "
                     + " | ".join(f"{s[m]:.3f}" for m in metrics) + " |")
    table = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(table)
    (args.out / "meta.json").write_text(json.dumps({"command": command, "commit": git_commit(),
                                                     "date": time.strftime("%Y-%m-%d"), "summary": summary}, indent=1))
    _plot(summary, args.oracle_ks, args.out / "recall_vs_m.png")
    print(table)


def _plot(summary, ks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summary:  # x: m, ending with the policy's own k (the usual oracle top-k recall)
        xs = [m for m in ks if m < s["topk"]] + [s["topk"]]
        ys = [s[f"oracle_recall_top{m}"] for m in xs[:-1]] + [s["oracle_recall"]]
        kept = f" (attention kept {s['oracle_mass']:.2f})" if "oracle_mass" in s else ""
        ax.plot(xs, ys, marker="o", label=f"{s['policy']} B={s['budget']}{kept}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m: the oracle's best m eligible tokens")
    ax.set_ylabel("share kept by the policy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
