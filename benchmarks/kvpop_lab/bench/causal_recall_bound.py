"""The highest oracle top-k recall any causal eviction policy can reach on the testbed, beside the recall the
scorers reach on the same sequences (KVpop arXiv:2607.05061, Fig. 7's metric; the bound:
:mod:`kvpop_lab.testbed.recall_bound`).

Every reasoning problem gets ``--twins - 1`` twins: the same context token for token, another question
(:func:`kvpop_lab.testbed.tasks.reasoning_twin`). A causal policy keeps the same tokens in all of them until the
question begins; the oracle of each twin keeps the tokens its own answer will attend to. The row
``causal_bound`` is the mean over layers, KV heads and problems of the best twin-mean recall one kept set can
reach at each query (1 from the question on); no static scorer, delayed mLSTM scorer or heuristic can exceed it
on these sequences. The other rows are the policies' usual oracle top-k recall on the same sequences.

Usage (the 4k testbed; GPU ~10 s a sequence, CPU ~1-2 min):
    python benchmarks/causal_recall_bound.py --model checkpoints/testbed-4k-teacher --out results/recall_bound_4k \\
        --length 4096 --n 8 --twins 4 --window 64 --compression 0.88 --knob reasoning.n_facts=10 \\
        --knob reasoning.steps=4 --oracle-kinds max,p2,mean \\
        --student kvpop_distill=checkpoints/testbed-4k-kvpop-cr88 --baselines streaming
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
from kvpop_lab.testbed.oracle import check_kind
from kvpop_lab.testbed.static_policies import add_benchmark_args, benchmark_setup, check_policy_args

PAPER_RECALL = 0.81  # the paper's global mean oracle top-k recall (Qwen3-4B, Fig. 7)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_benchmark_args(ap)
    ap.add_argument("--twins", type=int, default=4, help="sequences per problem: the problem and twins - 1 twins")
    ap.add_argument("--oracle-kinds", default="max",
                    help="comma-separated oracle kinds: max, mean or p<x> (power mean of order x > 1, e.g. p2)")
    ap.add_argument("--oracle-queries", choices=("target", "all"), default="target")
    ap.add_argument("--seed", type=int, default=0, help="seed of the twins' questions")
    args = ap.parse_args(argv)
    check_policy_args(ap, args)
    if args.twins < 2:
        ap.error(f"--twins must be >= 2 (the problem and at least one twin), got {args.twins}")
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    args.oracle_kinds = [k for k in args.oracle_kinds.split(",") if k]
    if not args.oracle_kinds:
        ap.error("--oracle-kinds names no kind")
    for kind in args.oracle_kinds:
        try:
            check_kind(kind)
        except ValueError as err:
            ap.error(f"--oracle-kinds: {err}")
    return args


def summarise(rows: list[dict]) -> list[dict]:
    """Mean recall over layers, heads and problems per (oracle, policy, budget), with the lowest and highest
    layer mean."""
    out = []
    for key in dict.fromkeys((r["oracle"], r["policy"], r["budget"], r["cr"]) for r in rows):
        sel = [r for r in rows if (r["oracle"], r["policy"], r["budget"], r["cr"]) == key]
        layers = sorted({r["layer"] for r in sel})
        per_layer = [torch.tensor([r["recall"] for r in sel if r["layer"] == li]).nanmean().item() for li in layers]
        out.append({"oracle": key[0], "policy": key[1], "budget": key[2], "cr": key[3],
                    "recall": torch.tensor([r["recall"] for r in sel]).nanmean().item(),
                    "layer_min": min(per_layer), "layer_max": max(per_layer), "per_layer": per_layer})
    return out


def main(argv=None):
    args = parse_args(argv)
    from kvpop_lab.testbed.recall_bound import twin_recall_rows

    model, tok, problems, scored = benchmark_setup(args)
    dev = torch.device(args.device)
    t0 = time.time()
    rows = twin_recall_rows(model, tok, problems, args.twins, scored, args.oracle_kinds, queries=args.oracle_queries,
                            seed=args.seed)
    summary = summarise(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "recall_per_head.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    command = "python benchmarks/causal_recall_bound.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [f"<!-- {command} -->",
             f"<!-- commit {git_commit()} | {time.strftime('%Y-%m-%d')} | device {dev} | {args.n} problems x "
             f"{args.twins} twins, oracle of {args.oracle_queries} queries, {time.time() - t0:.0f} s -->", "",
             "| oracle | policy | B | cr | oracle top-k recall | lowest layer | highest layer |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        name = "**any causal policy (bound)**" if s["policy"] == "causal_bound" else s["policy"]
        lines.append(f"| {s['oracle']} | {name} | {s['budget']} | {s['cr']:.2f} | {s['recall']:.3f} | "
                     f"{s['layer_min']:.3f} | {s['layer_max']:.3f} |")
    table = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(table)
    (args.out / "meta.json").write_text(json.dumps({"command": command, "commit": git_commit(),
                                                     "date": time.strftime("%Y-%m-%d"), "device": str(dev),
                                                     "summary": summary}, indent=1))
    _plot(summary, args.out / "recall_per_layer.png")
    print(table)


def _plot(summary, path):
    """Recall per layer, a panel per oracle kind: a colour per policy (black dashes: the causal bound), a line
    style per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(s["oracle"] for s in summary))
    policies = [p for p in dict.fromkeys(s["policy"] for s in summary) if p != "causal_bound"]
    budgets = list(dict.fromkeys(s["budget"] for s in summary))
    colours = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    styles = ["-", ":", "-.", (0, (1, 3))]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 4.0), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        for s in (s for s in summary if s["oracle"] == kind):
            bound = s["policy"] == "causal_bound"
            style = styles[budgets.index(s["budget"]) % len(styles)]
            ax.plot(range(len(s["per_layer"])), s["per_layer"], marker="s" if bound else "o", markersize=4,
                    linestyle="--" if bound and style == "-" else style, color="black" if bound else colours[s["policy"]],
                    linewidth=2 if bound else 1.2,
                    label=("any causal policy" if bound else s["policy"]) + f", B={s['budget']}")
        ax.axhline(PAPER_RECALL, color="gray", linewidth=0.8, linestyle=":")
        ax.set_title(f"oracle: {kind} future attention")
        ax.set_xlabel("layer")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"oracle top-k recall (grey: the paper's {PAPER_RECALL})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (len(labels) // 6), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
