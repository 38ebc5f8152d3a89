"""Whole-model training step at real scale: KVpopTrainer against a plain LoRA step, on one GPU.

    # one H200, Qwen3-8B shape (random bf16 weights), 16k and 32k tokens (benchmarks/gpu/training_scale.sh)
    python benchmarks/training_scale.py --shape qwen3-8b --seq-lens 16384,32768 \
        --out-prefix results/training_scale/h200_qwen3-8b
    # CPU smoke test (tiny shape)
    python benchmarks/training_scale.py --shape tiny --device cpu --seq-lens 256 --steps 2 --out-prefix /tmp/ts

Rows (same model, same data, batch 1, bf16, gradient checkpointing, LoRA rank ``--lora-rank`` on q/k/v/o):

* ``lora_sft``: plain ``transformers.Trainer``, causal-LM loss on the model's logits, ``sdpa``;
* ``lora_distill``: dense ``sdpa`` attention, teacher = the same model with its adapters disabled, the chunked KL
  of ``kvpop_hf.trainer.chunked_distillation`` (the honest baseline of distillation);
* ``kvpop_scorer_only:<scorer>``: ``KVpopTrainer(train_backbone=False)``, no LoRA, no teacher;
* ``kvpop_distill:<scorer>``: ``KVpopTrainer`` with LoRA: distillation + boundary loss.

Budget: sinks ``--sinks``, window ``--window``, ``topk = S * (1 - compression) - sinks - window`` (88% by default).
Per row: ``--steps`` timed steps after one warm-up step (which compiles); step time = wall time between the
step's begin and end callbacks after a device synchronisation; median reported. ``tokens_per_s = S / step_s``.
``peak_gb`` = ``torch.cuda.max_memory_allocated`` over the row's steps, in GB (1e9 bytes), weights included.
``--profile``: one more step under ``torch.profiler``; the GPU time of the step is split into components by the
``record_function`` ranges that the trainer and the student attention open (``kvpop.*``) and by the backward
nodes (``CompiledFunctionBackward``: the FlexAttention backward of the sparse attention; the sdpa backward).
``--memory-snapshot ROW``: one more step of that row with the CUDA allocator's history recorded; what is live at
the step's peak is grouped by the first frame of this repository, transformers or peft that allocated it.

Writes ``<prefix>.csv`` (exactly ``trainer,scorer,seq_len,step_s,tokens_per_s,peak_gb``; an out-of-memory row
has empty numbers), ``<prefix>_components.csv``, ``<prefix>.md`` (command, commit, date, tables, memory
breakdowns) and ``<prefix>.png`` (tokens/s and peak memory against sequence length). Rows already in the CSV
for other (trainer, scorer, seq_len) keys are kept, so several invocations build one table.
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime as dt
import gc
import json
import math
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Trainer, TrainerCallback, TrainingArguments

from kvpop_lab.utils.provenance import git_commit, versions
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments
from kvpop_lab.utils.timing import fmt as fmt_number, is_oom
from kvpop_hf.trainer.hidden_states import final_hidden_states
from kvpop_hf.trainer.teacher_distillation import distillation_from_hidden, supervised_positions
from kvpop_hf.trainer.trainer import LOG_GAMMA_ATTR, SCORER_ATTR

CSV_COLUMNS = ["trainer", "scorer", "seq_len", "step_s", "tokens_per_s", "peak_gb"]
SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, tied embeddings
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "qwen3-4b": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "tiny": (64, 128, 2, 4, 2, 16, 512, False),
}
TRAINERS = ("lora_sft", "lora_distill", "kvpop_scorer_only", "kvpop_distill")
DEFAULT_ROWS = "lora_sft,lora_distill,kvpop_scorer_only:mlstm,kvpop_distill:mlstm,kvpop_distill:mlp"
COMPONENTS = ("teacher_forward", "distillation", "scoring", "running_topk", "sparse_attention",
              "sparse_attention_backward", "target_pass", "boundary_loss", "dense_attention", "rest")


def parse_rows(text: str) -> list[tuple[str, str, int | None]]:
    """``trainer[:scorer][@seq_len]`` items -> (trainer, scorer or 'none', seq_len or None = every --seq-lens)."""
    rows = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        spec, _, at = item.partition("@")
        trainer, _, scorer = spec.partition(":")
        if trainer not in TRAINERS:
            raise ValueError(f"--rows: unknown trainer {trainer!r}; choose from {', '.join(TRAINERS)}.")
        if trainer.startswith("kvpop") and scorer not in ("mlstm", "mlp"):
            raise ValueError(f"--rows: {item!r} needs a scorer, e.g. {trainer}:mlstm or {trainer}:mlp.")
        if trainer.startswith("lora") and scorer:
            raise ValueError(f"--rows: {trainer} has no scorer (got {item!r}).")
        if at and not at.isdigit():
            raise ValueError(f"--rows: {item!r}: what follows @ must be a sequence length, e.g. {spec}@32768.")
        rows.append((trainer, scorer or "none", int(at) if at else None))
    if not rows:
        raise ValueError("--rows is empty.")
    return rows


def parse_seq_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seq-lens must be a comma-separated list of integers, got {text!r}.") from None
    if not lens or min(lens) < 2:
        raise ValueError(f"--seq-lens needs lengths >= 2, got {text!r}.")
    return lens


def budget(seq_len: int, sinks: int, window: int, compression: float) -> int:
    """topk of the row: ``S * (1 - compression) - sinks - window``; an error if that leaves no slot."""
    topk = int(round(seq_len * (1 - compression))) - sinks - window
    if topk < 1:
        raise ValueError(f"seq_len {seq_len} at {compression:.0%} compression leaves no long-range slot beside "
                         f"{sinks} sinks and a {window}-token window: lower --window or --compression.")
    return topk


# ----------------------------------------------------------------------------------------------- model
def build_model(shape: str, device, dtype, max_pos: int):
    hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, tie_word_embeddings=tied, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model


def restore(base) -> None:
    """Undo what a row did to the shared base model (scorer, decay, attention, checkpointing, input hooks)."""
    base._modules.pop(SCORER_ATTR, None)
    base._parameters.pop(LOG_GAMMA_ATTR, None)
    base.set_attn_implementation("sdpa")
    if getattr(base, "is_gradient_checkpointing", False):
        base.gradient_checkpointing_disable()
    if hasattr(base, "_require_grads_hook"):
        base.disable_input_require_grads()
    base.requires_grad_(False)


class DenseDistillTrainer(Trainer):
    """``lora_distill``: dense attention, teacher = adapters disabled, the chunked KL of the KVpop trainer."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        _, hidden = final_hidden_states(model, input_ids=ids)
        with torch.no_grad(), model.disable_adapter():
            _, t_hidden = final_hidden_states(model, input_ids=ids)
        return distillation_from_hidden(model, None, hidden, t_hidden, 1.0, supervised_positions(inputs["labels"]))


# ----------------------------------------------------------------------------------------------- timing
class StepClock(TrainerCallback):
    """Wall time of every optimizer step (device synchronised at both ends); peak memory; optional profiler /
    allocator history around the steps after ``timed`` ones."""

    def __init__(self, device, timed: int, profile: bool, snapshot: bool):
        self.device, self.timed, self.profile, self.snapshot = device, timed, profile, snapshot
        self.times, self.prof, self.snap = [], None, None
        self.step = 0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _extra(self):
        """Which extra step this is: 'profile', 'snapshot' or None (a timed or warm-up step)."""
        k = self.step - (1 + self.timed)
        extras = (["profile"] if self.profile else []) + (["snapshot"] if self.snapshot else [])
        return extras[k] if 0 <= k < len(extras) else None

    def on_train_begin(self, args, state, control, **kw):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_step_begin(self, args, state, control, **kw):
        extra = self._extra()
        if extra == "profile":
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif extra == "snapshot" and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        self._sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        dt_s = time.perf_counter() - self.t0
        extra = self._extra()
        if extra is None:
            self.times.append(dt_s)
            if self.device.type == "cuda":
                self.peak = torch.cuda.max_memory_allocated(self.device)
        elif extra == "profile":
            self.prof.__exit__(None, None, None)
        elif extra == "snapshot" and self.device.type == "cuda":
            self.snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        self.step += 1


def component_times(prof, device_type: str = "cuda") -> dict[str, float]:
    """Milliseconds of one profiled step per component (see the module docstring; GPU time on CUDA, CPU time
    elsewhere); 'rest' is the remainder of the step's total."""
    gpu = device_type == "cuda"
    total_of = (lambda e: e.device_time_total) if gpu else (lambda e: e.cpu_time_total)
    events = prof.events()
    if gpu:
        total = sum(e.self_device_time_total for e in events if str(getattr(e, "device_type", "")).endswith("CPU"))
    else:
        total = sum(e.cpu_time_total for e in events if e.cpu_parent is None)
    total /= 1e3
    out = collections.Counter()

    def nested_kvpop(e):
        found = []
        for c in e.cpu_children:
            found.extend([c] if c.name.startswith("kvpop.") else nested_kvpop(c))
        return found

    for e in events:
        name = e.name
        if not str(getattr(e, "device_type", "CPU")).endswith("CPU"):
            continue  # the GPU-side copies of the ranges (gpu_user_annotation) would count twice
        if name.startswith("kvpop.") and not _under(e, "autograd::engine::evaluate_function: _RecomputedPriorities"):
            inner = sum(total_of(c) for c in nested_kvpop(e))
            out[name[len("kvpop."):]] += (total_of(e) - inner) / 1e3
        elif name.startswith("autograd::engine::evaluate_function:"):
            if "RecomputedPriorities" in name:
                out["scoring"] += total_of(e) / 1e3
            elif "CompiledFunctionBackward" in name or "FlexAttention" in name:
                out["sparse_attention_backward"] += total_of(e) / 1e3
            elif "AttentionBackward" in name:
                out["dense_attention"] += total_of(e) / 1e3
        elif name in ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                      "aten::_scaled_dot_product_cudnn_attention") and not _under(e, "kvpop."):
            out["dense_attention"] += total_of(e) / 1e3
    comp = {k: out.get(k, 0.0) for k in COMPONENTS if k != "rest"}
    comp["rest"] = max(0.0, total - sum(comp.values()))
    comp["total_ms"] = total
    return comp


def _under(e, prefix):
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(prefix):
            return True
        p = p.cpu_parent
    return False


def peak_breakdown(snapshot: dict, top: int = 14) -> tuple[float, list[tuple[str, float]]]:
    """(peak GB, [(allocating frame, GB live at the peak)]) from an allocator history snapshot: the trace is
    replayed; blocks allocated before recording began are not in it, so the peak is above that base."""
    traces = snapshot.get("device_traces", [[]])[0]
    live, cur, peak, at_peak = {}, 0, -1, {}
    for ev in traces:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    groups = collections.Counter()
    for ev in at_peak.values():
        groups[_frame_label(ev.get("frames", []))] += ev["size"]
    return max(peak, 0) / 1e9, [(k, v / 1e9) for k, v in groups.most_common(top)]


def _frame_label(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        for key in ("kvpop_hf/", "transformers/", "peft/", "benchmarks/", "torch/utils/checkpoint", "accelerate/"):
            if key in name:
                return f"{name[name.index(key):]}:{f.get('line')} {f.get('name')}"
    return "(no python frame of the repo / transformers / peft)"


# ----------------------------------------------------------------------------------------------- one row
def run_row(base, trainer_name, scorer, seq_len, data, args, device, profile, snapshot):
    from kvpop_hf.trainer.lora import lora_student

    topk = budget(seq_len, args.sinks, args.window, args.compression)
    extra_steps = int(profile) + int(snapshot)
    common = dict(output_dir=str(Path(args.scratch) / f"{trainer_name}_{scorer}_{seq_len}"),
                  per_device_train_batch_size=1, max_steps=1 + args.steps + extra_steps, learning_rate=1e-4,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                  disable_tqdm=True, seed=0, gradient_checkpointing=True, bf16=device.type == "cuda",
                  use_cpu=device.type == "cpu", dataloader_num_workers=0)
    model = base
    if trainer_name != "kvpop_scorer_only":
        model = lora_student(base, args.lora_rank)
    clock = StepClock(device, args.steps, profile, snapshot)
    if trainer_name == "lora_sft":
        trainer = Trainer(model=model, args=TrainingArguments(**common, remove_unused_columns=False),
                          train_dataset=data, callbacks=[clock])
    elif trainer_name == "lora_distill":
        trainer = DenseDistillTrainer(model=model, args=TrainingArguments(**common, remove_unused_columns=False),
                                      train_dataset=data, callbacks=[clock])
        trainer.model_accepts_loss_kwargs = False
    else:
        kargs = KVpopTrainingArguments(**common, sinks=args.sinks, window=args.window, topk=topk, scorer=scorer,
                                       train_backbone=trainer_name == "kvpop_distill")
        trainer = KVpopTrainer(model=model, args=kargs, train_dataset=data, callbacks=[clock])
    try:
        trainer.train()
    finally:
        del trainer
        if model is not base:
            model.unload()
        restore(base)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step_s = statistics.median(clock.times)
    peak = getattr(clock, "peak", float("nan"))
    row = dict(trainer=trainer_name, scorer=scorer, seq_len=seq_len, step_s=step_s, tokens_per_s=seq_len / step_s,
               peak_gb=peak / 1e9, topk=topk, steps=len(clock.times))
    comps = component_times(clock.prof, device.type) if clock.prof is not None else None
    snap = peak_breakdown(clock.snap) if clock.snap is not None else None
    return row, comps, snap


# ----------------------------------------------------------------------------------------------- output
def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open() as fh:
        return list(csv.DictReader(fh))


def merge(old: list[dict], new: list[dict], keys=("trainer", "scorer", "seq_len")) -> list[dict]:
    fresh = {tuple(str(r[k]) for k in keys) for r in new}
    kept = [r for r in old if tuple(str(r[k]) for k in keys) not in fresh]
    rows = kept + new
    order = {t: i for i, t in enumerate(TRAINERS)}
    return sorted(rows, key=lambda r: (int(r["seq_len"]), order.get(r["trainer"], 9), r["scorer"]))


def fmt(x, nd=2):
    """A CSV cell (a string, a number or empty) as a table number: ``kvpop_lab.utils.timing.fmt`` of its value."""
    try:
        return fmt_number(float(x), nd)
    except (TypeError, ValueError):
        return "-"


def write_outputs(prefix: Path, rows: list[dict], comps: list[dict], notes: list[str], header: dict):
    """Merge this invocation's rows into the CSVs at ``prefix``, then rewrite the markdown and the plot from them.
    ``<prefix>_runs.json`` keeps every invocation's header and notes."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    new_rows = rows
    rows = merge(read_rows(prefix.with_suffix(".csv")), rows)
    with prefix.with_suffix(".csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (r.get(k, "") if not isinstance(r.get(k), float) else
                            ("" if math.isnan(r[k]) else f"{r[k]:.4g}")) for k in CSV_COLUMNS})
    comp_path = Path(str(prefix) + "_components.csv")
    comps = merge(read_rows(comp_path), comps)
    comp_cols = ["trainer", "scorer", "seq_len", "total_ms", *COMPONENTS]
    with comp_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=comp_cols, extrasaction="ignore")
        w.writeheader()
        for r in comps:
            w.writerow({k: (f"{float(r[k]):.1f}" if k not in ("trainer", "scorer", "seq_len") else r[k])
                        for k in comp_cols})
    runs_path = Path(str(prefix) + "_runs.json")
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    mine = [[r["trainer"], r["scorer"], int(r["seq_len"])] for r in new_rows]
    runs = [r for r in runs if r["header"] != header] + [{"header": header, "notes": notes, "rows": mine}]
    made_by = {}
    for i, run in enumerate(runs, 1):
        for key in run.get("rows", []):
            made_by[tuple(map(str, key))] = i
    runs_path.write_text(json.dumps(runs, indent=1))
    lines = ["# Training step at real scale (one GPU)", "",
             "Step time: median wall seconds of the timed steps (after one warm-up step); peak: "
             "`max_memory_allocated` in GB (1e9 bytes), weights included. Ratios: tokens/s against `lora_sft` / "
             "`lora_distill` at the same sequence length.", "",
             "| trainer | scorer | seq_len | s/step | tokens/s | peak GB | x lora_sft | x lora_distill | run |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ref = {(r["trainer"], int(r["seq_len"])): r for r in rows}
    for r in rows:
        S = int(r["seq_len"])
        tps = r.get("tokens_per_s")
        ratios = []
        for other in ("lora_sft", "lora_distill"):
            o = ref.get((other, S))
            try:
                ratios.append(f"{float(tps) / float(o['tokens_per_s']):.2f}")
            except (TypeError, ValueError, KeyError, ZeroDivisionError):
                ratios.append("-")
        oom = fmt(r.get("step_s")) == "-"
        lines.append(f"| {r['trainer']} | {r['scorer']} | {S} | {'out of memory' if oom else fmt(r.get('step_s'))} | "
                     f"{fmt(tps, 0)} | {fmt(r.get('peak_gb'), 1)} | {ratios[0]} | {ratios[1]} | "
                     f"{made_by.get((r['trainer'], r['scorer'], str(S)), '-')} |")
    if comps:
        lines += ["", "## Share of the step's GPU time per component (one profiled step)", "",
                  "GPU time on CUDA (CPU time on the CPU); `rest`: the backbone's matmuls, norms, MLP and "
                  "their backward, the optimizer.", "",
                  "| trainer | scorer | seq_len | total ms | " + " | ".join(COMPONENTS) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(COMPONENTS)]
        for c in comps:
            tot = float(c["total_ms"]) or float("nan")
            lines.append(f"| {c['trainer']} | {c['scorer']} | {c['seq_len']} | {fmt(c['total_ms'], 0)} | " +
                         " | ".join(f"{100 * float(c[k]) / tot:.1f}%" for k in COMPONENTS) + " |")
    lines += ["", "## Invocations (the `run` column)", ""]
    for i, run in enumerate(runs, 1):
        lines += [f"{i}. {run['header'].get('date')}: {run['header'].get('command')} at commit "
                  f"{run['header'].get('commit')}"]
        lines += [f"   - {k}: {v}" for k, v in run["header"].items() if k not in ("date", "command", "commit")]
        lines += [f"   - note: {n}" for n in run["notes"]]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(prefix, rows)


def plot(prefix: Path, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    series = collections.defaultdict(list)
    for r in rows:
        if str(r.get("step_s", "")) in ("", "nan"):
            continue
        peak = float(r["peak_gb"]) if str(r.get("peak_gb", "")) not in ("", "nan") else float("nan")
        series[(r["trainer"], r["scorer"])].append((int(r["seq_len"]), float(r["tokens_per_s"]), peak))
    for (t, s), pts in sorted(series.items()):
        pts.sort()
        label = t if s == "none" else f"{t} ({s})"
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        b.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    for ax, title in ((a, "tokens / s"), (b, "peak memory (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    b.axhline(141, color="grey", ls="--", lw=0.8)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--seq-lens", default="16384,32768")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="comma list of trainer[:scorer][@seq_len], run in this "
                    f"order, each at every --seq-lens unless @seq_len names one (default {DEFAULT_ROWS})")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row, after one warm-up step")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--compression", type=float, default=0.875)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="one more profiled step per row: component shares")
    ap.add_argument("--memory-snapshot", default="", help="comma list of rows (trainer[:scorer][@seq_len]) whose "
                    "step is recorded by the allocator's history")
    ap.add_argument("--max-seconds", type=float, default=float("inf"), help="start no row after this many seconds")
    ap.add_argument("--scratch", default="/tmp/kvpop_training_scale")
    ap.add_argument("--out-prefix", required=True)
    args = ap.parse_args(argv)
    seq_lens = parse_seq_lens(args.seq_lens)
    plan = [(t, sc, S) for t, sc, at in parse_rows(args.rows) for S in ([at] if at else seq_lens)]
    snapshots = parse_rows(args.memory_snapshot) if args.memory_snapshot else []
    seq_lens = sorted({S for _, _, S in plan})
    if args.steps < 1:
        raise ValueError("--steps must be >= 1.")
    for S in seq_lens:
        budget(S, args.sinks, args.window, args.compression)  # errors before any work
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu for the smoke test.")
    from kvpop_hf.trainer.lora import require_peft

    require_peft()  # the LoRA rows need it; an error naming the `train` extra before any work

    device = torch.device(args.device)
    t_start = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = build_model(args.shape, device, dtype, max(seq_lens))
    print(f"model built ({time.perf_counter() - t_start:.0f} s)", flush=True)
    base.requires_grad_(False)
    vocab = SHAPES[args.shape][6]
    header = {"command": "`python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv or sys.argv[1:])) + "`",
              "commit": git_commit(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              **versions("torch", "transformers", "triton", "peft"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "model": f"Qwen3 {args.shape} shape, random weights, {str(dtype).replace('torch.', '')}, "
                       f"{sum(p.numel() for p in base.parameters()) / 1e9:.2f} B parameters",
              "setup": f"batch 1, gradient checkpointing, LoRA rank {args.lora_rank} (q/k/v/o) except "
                       f"kvpop_scorer_only, sinks {args.sinks}, window {args.window}, "
                       f"{args.compression:.1%} compression, {args.steps} timed steps after 1 warm-up"}
    out_rows, out_comps, notes = [], [], []
    prefix = Path(args.out_prefix)
    data_by_len = {}
    for trainer_name, scorer, S in plan:
        if S not in data_by_len:
            g = torch.Generator().manual_seed(S)
            ids = torch.randint(0, vocab, (max(4, args.steps + 3), S), generator=g)
            data_by_len[S] = [{"input_ids": r, "labels": r.clone()} for r in ids]
        data = data_by_len[S]
        snapshot = any(t == trainer_name and sc == scorer and at in (None, S) for t, sc, at in snapshots)
        label = f"{trainer_name}:{scorer} @ {S}"
        if time.perf_counter() - t_start > args.max_seconds:
            notes.append(f"{label}: not run (--max-seconds {args.max_seconds:.0f} reached)")
            print(notes[-1], flush=True)
            continue
        t0 = time.perf_counter()
        try:
            row, comps, snap = run_row(base, trainer_name, scorer, S, data, args, device, args.profile, snapshot)
        except Exception as err:  # noqa: BLE001
            if not is_oom(err):
                traceback.print_exc()
                notes.append(f"{label}: error {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            else:
                notes.append(f"{label}: out of memory ({str(err).splitlines()[0][:160]})")
            out_rows.append(dict(trainer=trainer_name, scorer=scorer, seq_len=S, step_s=float("nan"),
                                 tokens_per_s=float("nan"), peak_gb=float("nan")))
            print(notes[-1], flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_outputs(prefix, out_rows, out_comps, notes, header)
            continue
        out_rows.append(row)
        print(f"{label}: {row['step_s']:.3f} s/step, {row['tokens_per_s']:.0f} tok/s, peak "
              f"{row['peak_gb']:.1f} GB, topk {row['topk']} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
        if comps is not None:
            out_comps.append(dict(trainer=trainer_name, scorer=scorer, seq_len=S, **comps))
            print("   components (ms): " + json.dumps({k: round(v, 1) for k, v in comps.items()}), flush=True)
        if snap is not None:
            peak_gb, groups = snap
            notes.append(f"{label}: allocator history of one step, {peak_gb:.1f} GB allocated during the step "
                         "at its peak (above what was live when recording began), by allocating frame: " +
                         "; ".join(f"{name} {gb:.2f} GB" for name, gb in groups))
            print(notes[-1], flush=True)
        write_outputs(prefix, out_rows, out_comps, notes, header)
    write_outputs(prefix, out_rows, out_comps, notes, header)
    print(f"wrote {prefix}.csv / .md / .png ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
