"""Delayed vs immediate mLSTM scoring (KVpop paper, Fig. 5 analogue) on the testbed teacher.

Trains two scorer-only retrofits with identical data, seed and budget that differ only in when the
mLSTM reads a token's score (after absorbing ``u + w`` = delayed, or right after ``u`` = immediate),
then measures on held-out reasoning problems the oracle top-k recall (``kvpop_lab.testbed.analysis``).
Writes ``<out>.md``, ``<out>.csv`` (training curves) and ``<out>.png``.

    python benchmarks/ablation_delay.py --steps 120 --seq-len 1024 --out results/ablation_delay_cpu
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
import types
from pathlib import Path

import torch

from kvpop_lab.utils.provenance import git_commit

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "testbed-4k-teacher"))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--cr", type=float, default=0.88)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--eval-n", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "results" / "ablation_delay_cpu"))
    args = ap.parse_args(argv)
    cmd = "python benchmarks/ablation_delay.py " + " ".join(sys.argv[1:] if argv is None else argv)
    commit = git_commit(ROOT)  # read before the run: the code that runs is this commit's
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop_hf import KVpopCache
    from kvpop_hf.cli import retrofit
    from kvpop_lab.testbed import make_problem
    from kvpop_lab.testbed.analysis import oracle_recall_rows

    B = round((1 - args.cr) * args.seq_len)
    topk = B - args.sinks - args.window
    if topk < 1:
        raise ValueError(f"budget {B} leaves no long-range slots with sinks={args.sinks}, window={args.window}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    curves, caches, t0 = {}, {}, time.time()
    for name, delayed in (("delayed", True), ("immediate", False)):
        ckpt = Path(f"/tmp/kvpop_ablation_{name}")
        train_argv = ["--model", args.model, "--dataset", "testbed:reasoning", "--seq_len", str(args.seq_len),
                "--sinks", str(args.sinks), "--window", str(args.window), "--topk", str(topk), "--scorer", "mlstm",
                "--scorer_kwargs", json.dumps({"delayed": delayed, "token_readout": False}), "--output_dir", str(ckpt),
                "--max_steps", str(args.steps), "--per_device_train_batch_size", "2", "--learning_rate", "3e-3",
                "--train_backbone", "False", "--logging_steps", "10", "--report_to", "none",
                "--save_strategy", "no", "--seed", "0", "--disable_tqdm", "True"]
        if args.device == "cpu":
            train_argv.append("--use_cpu")
        trainer = retrofit.train(train_argv)
        curves[name] = [e for e in trainer.state.log_history if "boundary_loss" in e]
        caches[name] = KVpopCache.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    problems = [make_problem("reasoning", length=args.seq_len, seed=2 ** 48 + 1000 + i) for i in range(args.eval_n)]
    budget = types.SimpleNamespace(B=B, cr=args.cr)
    rows = oracle_recall_rows(model, tok, problems, [(n, budget, c) for n, c in caches.items()], progress=False)
    held_out = {n: sum(r["oracle_recall"] for r in rows if r["policy"] == n) / sum(r["policy"] == n for r in rows)
                for n in caches}
    with open(f"{out}.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["variant", "step", "boundary_loss", "target_topk_recall"])
        for n, c in curves.items():
            for e in c:
                w.writerow([n, e["step"], e["boundary_loss"], e["target_topk_recall"]])
    lines = [f"# Delayed vs immediate mLSTM scoring (testbed, {args.device})", "",
             f"Command: `{cmd}`  ", f"Commit: `{commit}`; total {time.time() - t0:.0f} s  ",
             f"Teacher `{args.model}`, scorer-only retrofits on reasoning, S = {args.seq_len}, "
             f"B = {B} ({args.sinks} + {args.window} + {topk}, {args.cr:.0%} compression), {args.steps} steps, "
             "batch 2, seed 0.", "",
             "| variant | boundary loss (first log) | boundary loss (last log) | "
             "teacher top-k recall (training, last log) | "
             f"held-out oracle recall ({args.eval_n} problems) |", "|---|---|---|---|---|"]
    for n, c in curves.items():
        lines.append(f"| {n} | {c[0]['boundary_loss']:.4f} | {c[-1]['boundary_loss']:.4f} | "
                     f"{c[-1]['target_topk_recall']:.4f} | {held_out[n]:.4f} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for n, c in curves.items():
            axes[0].plot([e["step"] for e in c], [e["boundary_loss"] for e in c], label=n)
            axes[1].plot([e["step"] for e in c], [e["target_topk_recall"] for e in c], label=n)
        axes[0].set(xlabel="step", ylabel="boundary loss")
        axes[1].set(xlabel="step", ylabel="teacher top-k recall")
        axes[1].legend()
        fig.tight_layout()
        fig.savefig(f"{out}.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
