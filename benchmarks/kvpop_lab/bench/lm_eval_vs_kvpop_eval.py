"""The same testbed problems through ``kvpop-eval`` and through lm-eval's command line with ``--model kvpop``:
both exact matches, side by side, problem by problem.

    python benchmarks/lm_eval_vs_kvpop_eval.py --student checkpoints/testbed-4k-kvpop-cr88 \\
        --teacher checkpoints/testbed-4k-teacher --n 8 --out out/lm_eval_vs_kvpop_eval

The policy and budget default to the shipped 4k student: ``kvpop_distill`` at B = 492 = 4 sinks + 64 window + 424
slots, reasoning problems of 4096 tokens with ``n_facts=10, steps=4``, seeds ``2**48 + i``. Both sides run the
student with its own cache, float32, greedy, batch 8. Writes ``result.json`` and ``result.md`` (command, commit,
date, both exact matches and the problems where they differ) and keeps both runs' folders. ``--extra`` runs the
teacher through lm-eval too (dense via ``--model hf``, StreamingLLM at the same budget) and writes
``kvpop-lm-eval-table``'s table of the lm-eval runs under ``table/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run(cmd: list[str], log: Path) -> float:
    import time

    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(cmd)}; see {log}")
    return round(time.time() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    from kvpop_lab.utils.provenance import git_commit, versions

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--student", required=True, help="model folder with its KVpop checkpoint (own-weights policy)")
    ap.add_argument("--teacher", required=True, help="kvpop-eval's --model and the tokenizer (a LoRA student folder holds none; its base model's is the same)")
    ap.add_argument("--policy", default="kvpop_distill")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--budgets", dest="budget", type=int, default=492, help="B = sinks + window + topk (one count)")
    ap.add_argument("--knob", action="append", default=None, help="default: reasoning.n_facts=10, reasoning.steps=4")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--extra", default="dense,streaming",
                    help="policies run on --teacher through lm-eval only (dense = --model hf), then kvpop-lm-eval-table")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    knobs = args.knob or ["reasoning.n_facts=10", "reasoning.steps=4"]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    topk = args.budget - args.sinks - args.window

    tasks = out / "tasks"
    export = [py, "-m", "kvpop_lab.testbed.lm_eval_tasks", "--out", str(tasks), "--tokenizer", args.teacher,
              "--families", "reasoning", "--lengths", str(args.length), "--n", str(args.n)]
    for k in knobs:
        export += ["--knob", k]
    kvpop_eval = [py, "-m", "kvpop_lab.testbed.evaluate", "--model", args.teacher, "--tokenizer", args.teacher,
                  "--out", str(out / "kvpop_eval"), "--families", "reasoning", "--policies", args.policy,
                  "--scorer-checkpoint", f"{args.policy}={args.student}", "--budgets", str(args.budget),
                  "--sinks", str(args.sinks), "--window", str(args.window), "--n", str(args.n),
                  "--length", str(args.length), "--batch-size", str(args.batch_size), "--device", "cpu",
                  "--no-progress"]
    for k in knobs:
        kvpop_eval += ["--knob", k]
    task = f"kvpop_reasoning_{args.length}"
    lm_eval = [py, "-m", "kvpop_hf.integrations.lm_eval", "run", "--model", "kvpop", "--model_args",
               f"pretrained={args.student},policy={args.policy},sinks={args.sinks},window={args.window},"
               f"topk={topk},dtype=float32", "--tasks", task, "--include_path", str(tasks), "--device", "cpu",
               "--batch_size", str(args.batch_size), "--output_path", str(out / "lm_eval"), "--log_samples"]
    secs = {"export": run(export, out / "export.log"), "kvpop_eval": run(kvpop_eval, out / "kvpop_eval.log"),
            "lm_eval": run(lm_eval, out / "lm_eval.log")}
    # the teacher through lm-eval alone: dense (--model hf) and StreamingLLM at the same budget, then the table
    extra: dict[str, float] = {}
    for name in [x for x in args.extra.split(",") if x]:
        model, margs = ("hf", f"pretrained={args.teacher},dtype=float32") if name == "dense" else (
            "kvpop", f"pretrained={args.teacher},policy={name},sinks={args.sinks},window={args.window},topk={topk},"
                     "dtype=float32")
        cmd = [py, "-m", "kvpop_hf.integrations.lm_eval", "run", "--model", model, "--model_args", margs, "--tasks",
               task, "--include_path", str(tasks), "--device", "cpu", "--batch_size", str(args.batch_size),
               "--output_path", str(out / f"lm_eval_teacher_{name}")]
        secs[f"lm_eval_teacher_{name}"] = run(cmd, out / f"lm_eval_teacher_{name}.log")
        res = json.loads(next((out / f"lm_eval_teacher_{name}").rglob("results_*.json")).read_text())
        extra[name] = res["results"][task]["exact_match,rollouts"]
    table = None
    if extra:
        runs = [str(out / f"lm_eval_teacher_{n}") for n in extra] + [str(out / "lm_eval")]
        run([py, "-m", "kvpop_hf.integrations.lm_eval_table", *runs, "--out", str(out / "table"), "--length",
             str(args.length)], out / "table.log")
        table = (out / "table" / "table.md").read_text()

    ours = [json.loads(x) for x in (out / "kvpop_eval" / "outputs.jsonl").read_text().splitlines()]
    ke = {r["seed"]: bool(r["correct"]) for r in ours if r["policy"] == args.policy}
    samples = [json.loads(x) for x in next((out / "lm_eval").rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    le = {s["doc"]["seed"]: s["exact_match"] == 1.0 for s in samples}
    if set(ke) != set(le):
        raise SystemExit(f"the two runs saw different problems: {sorted(ke)} vs {sorted(le)}")
    differ = sorted(s for s in ke if ke[s] != le[s])
    result = {
        "command": shlex.join([py, *sys.argv]) if argv is None else shlex.join(["benchmarks/lm_eval_vs_kvpop_eval.py",
                                                                               *argv]),
        "commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions("torch", "transformers", "lm_eval", missing=None),
        "commands": {"export": shlex.join(export), "kvpop_eval": shlex.join(kvpop_eval), "lm_eval": shlex.join(lm_eval)},
        "n": len(ke), "kvpop_eval_em": sum(ke.values()) / len(ke), "lm_eval_em": sum(le.values()) / len(le),
        "kvpop_eval_correct": sum(ke.values()), "lm_eval_correct": sum(le.values()),
        "problems_that_differ": [s - 2 ** 48 for s in differ], "teacher_lm_eval_em": extra, "seconds": secs,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# lm-eval --model kvpop vs kvpop-eval on the same problems\n\n`{result['command']}` (commit "
          f"{result['commit']}, {result['date']})\n\n| | exact match | correct |\n|---|---|---|\n"
          f"| kvpop-eval | {result['kvpop_eval_em']:.3f} | {result['kvpop_eval_correct']} of {len(ke)} |\n"
          f"| lm-eval --model kvpop | {result['lm_eval_em']:.3f} | {result['lm_eval_correct']} of {len(le)} |\n\n"
          f"Problems (i of seed 2^48 + i) answered differently: {result['problems_that_differ'] or 'none'}.\n")
    if extra:
        md += ("\nThe teacher through lm-eval on the same problems: " + ", ".join(
            f"{k} {v:.3f}" for k, v in extra.items()) + f" (B = {args.budget} for the compressing ones).\n\n"
               "kvpop-lm-eval-table over the lm-eval runs (`table/`):\n\n" + table.split("\n", 2)[2])
    (out / "result.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
