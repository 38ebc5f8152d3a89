"""Plot the teacher-forced fact-lookup accuracy logged by ``pretrain_teacher.py --probe-every`` against the
training step, one line per run: shows whether and when the fact copy formed (chance ~0.1).

    python benchmarks/plot_probe_curves.py --out results/teacher/lookup_probe.png \\
        P=results/teacher/recipes_side_by_side/teacher_P.log Q=...

Each ``NAME=PATH`` is a training log (``probe step N: {...}`` lines) or a teacher ``manifest.json``
(``probe_curve``). Also writes the curves as CSV next to the PNG.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re

PROBE = re.compile(r"probe step \d+: (\{.*\})")


def read_curve(path: str) -> list[dict]:
    """``[{"step", "lookup_acc", "token_acc"}, ...]`` from a log or a manifest."""
    if path.endswith(".json"):
        with open(path) as f:
            return list(json.load(f).get("probe_curve", []))
    with open(path, errors="replace") as f:
        return [json.loads(m.group(1)) for m in map(PROBE.search, f.read().replace("\r", "\n").splitlines()) if m]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="PNG path (a .csv with the same stem is written too)")
    ap.add_argument("--title", default="teacher-forced fact-lookup accuracy during training")
    ap.add_argument("runs", nargs="+", help="NAME=PATH (training log or manifest.json)")
    args = ap.parse_args(argv)
    curves = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep or not os.path.isfile(path):
            raise SystemExit(f"expected NAME=PATH with an existing file, got {item!r}")
        curves[name] = read_curve(path)
        if not curves[name]:
            raise SystemExit(f"{path}: no probe records (was the run started with --probe-every?)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, c in curves.items():
        ax.plot([r["step"] for r in c], [r["lookup_acc"] for r in c], marker=".", label=name)
    ax.axhline(0.1, color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("training step")
    ax.set_ylabel("fact-lookup accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    with open(os.path.splitext(args.out)[0] + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "lookup_acc", "token_acc"])
        for name, c in curves.items():
            for r in c:
                w.writerow([name, r["step"], r["lookup_acc"], r["token_acc"]])
    for name, c in curves.items():
        print(f"{name}: {len(c)} probes, last step {c[-1]['step']} lookup {c[-1]['lookup_acc']:.3f}")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
