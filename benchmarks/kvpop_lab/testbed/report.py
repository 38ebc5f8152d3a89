"""Reports of ``kvpop-eval``: results CSV, markdown tables (KVpop arXiv:2607.05061 Tables 1/2), the
quality-vs-budget plot and the run metadata (command line, git commit, versions, seeds).

A result row is a dict with ``policy, budget ("full" for dense), cr, sinks, window, topk, family,
em, token_acc, lookup_acc (NaN for families without fact lookups), n, n_target_tokens``.

The bottom of the testbed's evaluation stack: ``evaluate -> analysis -> report`` (this module imports neither).
"""

from __future__ import annotations

import csv
import math
import shlex
import sys
from pathlib import Path
from typing import Sequence

from kvpop_lab.utils.provenance import git_commit, versions
from kvpop_hf.plotting import line_styles, pyplot

__all__ = ["write_results_csv", "quality_table", "plot_quality", "build_meta", "md_header", "git_commit",
           "averages"]

COLUMNS = ["policy", "budget", "cr", "sinks", "window", "topk", "family", "em", "token_acc", "lookup_acc", "n",
           "n_target_tokens"]


def write_results_csv(rows: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def averages(rows: Sequence[dict], families: Sequence[str]) -> dict[tuple, dict]:
    """``{(policy, budget): {"cr", "em": {fam: x}, "token_acc": {fam: x}, "avg_em", "avg_acc"}}`` in row
    order; averages are unweighted means over ``families``."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["family"] not in families:
            continue
        key = (r["policy"], r["budget"])
        d = out.setdefault(key, {"cr": r["cr"], "em": {}, "token_acc": {}, "lookup_acc": {}})
        d["em"][r["family"]] = r["em"]
        d["token_acc"][r["family"]] = r["token_acc"]
        d["lookup_acc"][r["family"]] = r.get("lookup_acc", float("nan"))
    for d in out.values():
        d["avg_em"] = _mean([d["em"][f] for f in families if f in d["em"]])
        d["avg_acc"] = _mean([d["token_acc"][f] for f in families if f in d["token_acc"]])
        d["avg_lookup"] = _mean([d["lookup_acc"][f] for f in families if f in d["lookup_acc"]])
    return out


def _fmt(x: float, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def _rel(x: float, ref: float | None) -> str:
    if ref is None or math.isnan(ref) or ref == 0 or math.isnan(x):
        return "n/a"
    return f"{100 * x / ref:.1f}%"


def quality_table(rows: Sequence[dict], families: Sequence[str], title: str) -> str:
    """Markdown: one line per (policy, budget); exact match per family, its average and the average
    relative to dense, then the average teacher-forced token accuracy and its ratio to dense."""
    if not families:
        return f"## {title}\n\n_No families in this group for this run._\n"
    av = averages(rows, families)
    dense = next((d for (p, b), d in av.items() if b == "full"), None)
    d_em = dense["avg_em"] if dense else None
    d_acc = dense["avg_acc"] if dense else None
    d_lk = dense["avg_lookup"] if dense else None
    head = ["policy", "B", "cr"] + [f"EM {f}" for f in families] + ["EM avg", "EM vs dense", "tok acc avg",
                                                                      "tok acc vs dense", "lookup acc",
                                                                      "lookup acc vs dense"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (p, b), d in av.items():
        cells = [p, str(b), f"{d['cr']:.3f}"] + [_fmt(d["em"].get(f)) for f in families]
        cells += [_fmt(d["avg_em"]), _rel(d["avg_em"], d_em), _fmt(d["avg_acc"]), _rel(d["avg_acc"], d_acc),
                  _fmt(d["avg_lookup"]), _rel(d["avg_lookup"], d_lk)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "EM: greedy exact match of the whole target; tok acc: teacher-forced next-token accuracy on "
                  "the target tokens; lookup acc: the same on the tokens that copy a fact's value from the "
                  "context (reasoning only, chance ~0.1); averages are unweighted over families.", ""]
    return "\n".join(lines)


def plot_quality(rows: Sequence[dict], path: Path) -> None:
    """Average EM, token accuracy and fact-lookup accuracy (over the families in ``rows``) vs compression
    ratio, per policy."""
    plt = pyplot(path)
    if plt is None:
        return

    fams = sorted({r["family"] for r in rows})
    av = averages(rows, fams)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, name in ((axes[0], "avg_em", "exact match"), (axes[1], "avg_acc", "token accuracy"),
                          (axes[2], "avg_lookup", "fact-lookup accuracy")):
        by_policy: dict[str, list[tuple[float, float]]] = {}
        for (p, b), d in av.items():
            if b == "full":
                if not math.isnan(d[key]):
                    ax.axhline(d[key], ls="--", color="k", lw=1, label=f"{p} (full cache)")
                continue
            by_policy.setdefault(p, []).append((d["cr"], d[key]))
        styles = line_styles(sorted(by_policy))
        for p, pts in by_policy.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, **styles[p])
        ax.set_xlabel("compression ratio 1 - B / length")
        ax.set_ylabel(f"avg {name}")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    fig.legend(*axes[1].get_legend_handles_labels(), loc="center right", fontsize=8)
    fig.suptitle("Quality vs KV budget (avg over " + ", ".join(fams) + ")", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- metadata ----------------------------------------------------------------------------------------
def command_line(argv: Sequence[str]) -> str:
    """The evaluation's command line as a user types it (``kvpop-eval ARGS``)."""
    return "kvpop-eval " + shlex.join(list(argv))


def _versions() -> dict:
    return versions("torch", "transformers", "kvpop_hf", "matplotlib", missing=None)


def build_meta(argv, args, plan, timings, device, dtype) -> dict:
    runs = []
    for r in plan.runs:
        d = {"policy": r.policy, "checkpoint": r.checkpoint}
        if r.budget is not None:
            b = r.budget
            d.update(budget=b.B, cr=b.cr, sinks=b.sinks, window=b.window, topk=b.topk, spec=b.spec)
        if r.prototype is not None:
            cfg = getattr(r.prototype, "kvpop_config", None) or r.prototype.dms_config  # DMS: its own config
            d["checkpoint_config"] = cfg.to_dict()
        d["seconds"] = timings.get(r.label)
        runs.append(d)
    return {
        "command": command_line(argv),
        "argv": [sys.executable, "-m", "kvpop_lab.testbed.evaluate", *argv],
        "git_commit": git_commit(),
        "versions": _versions(),
        "model": args.model,
        "device": str(device),
        "dtype": str(dtype),
        "length": args.length,
        "n_per_family": args.n,
        "families": plan.families,
        "in_domain": plan.in_domain,
        "knobs": plan.knobs,
        "seeds": {"base": args.seed_base, "rule": "problem i of each family: make_problem(family, length, "
                  "seed=base + i)", "per_family": {f: [s[0], s[-1]] for f, s in plan.seeds.items()}},
        "runs": runs,
        "notes": plan.notes,
    }


def md_header(meta: dict) -> str:
    return (f"<!-- {meta['command']} -->\n<!-- git {meta['git_commit']} | " +
            ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) +
            f" | device {meta['device']} {meta['dtype']} | length {meta['length']} | n {meta['n_per_family']}"
            f" per family | seeds {meta['seeds']['base']} + i -->\n\n")


def compression_summary(stats: Sequence[dict]) -> dict:
    """Mean over problems of what a ragged-memory cache reports (``DMSCache.compression()``): ``kept_fraction``
    (kept / seen, averaged over layers and heads), ``compression`` = 1 - kept_fraction, ``kept_entries`` (mean
    entries per head), ``seen`` (mean tokens per problem), ``eviction_ratio`` ``[layers][kv_heads]`` (fraction of
    tokens marked for eviction) and ``kept_per_head`` ``[layers][kv_heads]`` (mean entries held)."""
    kept = sum(s["kept_fraction"] for s in stats) / len(stats)
    entries = sum(float(s["kept"].mean()) for s in stats) / len(stats)
    ratio = sum(s["eviction_ratio"] for s in stats) / len(stats)
    per_head = sum(s["kept"].float().mean(1) for s in stats) / len(stats)  # [layers, kv_heads]
    seen = sum(float(s["seen"].float().mean()) for s in stats) / len(stats)
    return {"kept_fraction": kept, "compression": 1.0 - kept, "kept_entries": entries, "seen": seen, "n": len(stats),
            "eviction_ratio": [[round(float(x), 6) for x in row] for row in ratio],
            "kept_per_head": [[round(float(x), 3) for x in row] for row in per_head]}
