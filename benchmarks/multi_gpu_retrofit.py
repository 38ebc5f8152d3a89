"""Multi-GPU retrofit benchmark: KVpopTrainer under ``accelerate launch`` with DDP and FSDP2.

One LoRA retrofit (``training/retrofit.py``, unchanged code path) with the same data, seed and
global batch in three settings:

* ``1gpu``  -- one process (plain ``python``), per-device batch 1 x gradient accumulation 2;
* ``ddp``   -- ``accelerate launch --config_file training/accelerate_ddp.yaml`` on 2 GPUs, batch 1 each;
* ``fsdp``  -- ``accelerate launch --config_file training/accelerate_fsdp.yaml`` (FSDP2) on 2 GPUs, batch 1 each.

Reported per setting: optimizer steps, final loss, max |loss difference| to the 1-GPU curve at the
same step, tokens/s per GPU (steps after the first ``--warmup-steps`` only), peak
``torch.cuda.max_memory_allocated`` per rank, and the number of FSDP units (``fully_shard`` modules).

Choices (and why):

* **LoRA in all three settings.** Under FSDP the frozen teacher must not be an unsharded copy per
  rank, so the FSDP run uses ``--lora_rank`` (teacher = the same sharded weights with the adapters
  disabled). Using LoRA for DDP and the 1-GPU reference too gives one reference curve for both
  multi-GPU runs and keeps the three runs to a few minutes. (DDP with a full-backbone
  student + frozen copy goes through the same all-reduce; it is not timed here.)
* **Same global batch, same micro-batch shape.** 2 sequences per optimizer step everywhere; the 1-GPU
  run uses gradient accumulation 2 so every forward sees ``[1, seq_len]`` (same compiled kernels,
  comparable memory). The Trainer's sampler gives rank r the samples ``r, r+2, ...`` of the same
  shuffled order, so step k sees the same two sequences in all settings.
* **Weights loaded in float32, ``--bf16`` mixed precision.** accelerate's FSDP2 upcasts trainable
  parameters to fp32 anyway when mixed precision is on (and needs one dtype per unit); loading fp32
  everywhere keeps the three settings' master weights identical. Remaining differences: autocast
  (1 GPU / DDP) vs FSDP2's bf16 parameter cast, bf16 reduction order -> "within noise", not bitwise.
* **Constant learning rate, no warm-up**, so runs stopped early by the time guard stay comparable
  step by step (curves are compared on the common steps).
* **Model: random-init Qwen3 shape** (the Qwen3-1.7B decoder block: hidden 2048, 16 query / 8 KV
  heads, head_dim 128, intermediate 6144) with 20 layers and the testbed vocabulary (2418) ->
  ~1.02 B parameters; the benchmark needs no download, and random weights cost the
  same FLOPs. Saved once as bf16 safetensors (+ testbed tokenizer) to a scratch directory.
* **Data:** generated testbed reasoning traces (``--dataset testbed:reasoning``), fixed seeds.
* **Loss recorded:** the Trainer's logged ``loss`` every step (already averaged over ranks), via a
  `TrainerCallback` (``kvpop_hf.cli.retrofit.train(argv, callbacks=...)``); step times from ``on_step_end``.

Usage::

    # GPU machine (2 GPUs), from the repo root:
    OUT=/some/dir bash benchmarks/gpu/multi_gpu.sh
    # CPU smoke test of the plumbing (tiny model, torchrun + gloo instead of accelerate launch):
    python benchmarks/multi_gpu_retrofit.py run --device cpu --tiny --out /tmp/mgpu_smoke

Subcommands: ``run`` (everything), ``prepare`` (make the model), ``worker`` (one training process;
what the launchers start), ``report`` (tables / JSON / plot from the worker files).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("1gpu", "ddp", "fsdp")


# --------------------------------------------------------------------------------------------- model
def prepare(model_dir: Path, tiny: bool, layers: int, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kvpop_lab.testbed import build_tokenizer

    tok = build_tokenizer()
    if tiny:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128)
    else:
        shape = dict(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, intermediate_size=6144)
    cfg = Qwen3Config(vocab_size=len(tok), max_position_embeddings=40960, rope_theta=1_000_000.0,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    info = {"n_params": n_params, "config": shape, "vocab_size": len(tok), "dtype_saved": "bfloat16",
            "init": "random (seed 0), no pretrained weights"}
    (model_dir / "bench_model.json").write_text(json.dumps(info, indent=1))
    return info


# -------------------------------------------------------------------------------------------- worker
def worker(result: Path, retro_argv: list[str]) -> None:
    """One training process: `kvpop_hf.cli.retrofit.train` (what training/retrofit.py runs), recording each step."""
    import torch
    from transformers import TrainerCallback

    from kvpop_hf.cli import retrofit

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and "--use_cpu" not in retro_argv
    rec = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "argv": retro_argv, "steps": [],
           "step_end_times": [], "status": "started"}
    path = result.with_name(f"{result.name}.rank{rank}.json")

    def dump():
        path.write_text(json.dumps(rec, indent=1))

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            rec["t_train_begin"] = time.time()
            if cuda:
                rec["mem_after_prepare_GiB"] = torch.cuda.memory_allocated() / 2**30
            if model is not None:
                try:
                    from torch.distributed.fsdp import FSDPModule
                    rec["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
                except ImportError:
                    rec["fsdp_units"] = None
                rec["model_class"] = type(model).__name__
                rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            dump()

        def on_step_end(self, args, state, control, **kw):
            rec["step_end_times"].append(time.time())
            if cuda:
                rec["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            dump()  # every step: a run killed by its time limit still leaves its curve

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "loss" in logs:
                rec["steps"].append({"step": state.global_step, "loss": float(logs["loss"]),
                                     "grad_norm": float(logs["grad_norm"]) if logs.get("grad_norm") is not None else None,
                                     **{k: float(logs[k]) for k in ("boundary_loss", "distill_loss",
                                                                    "target_topk_recall")
                                        if k in logs}})

        def on_train_end(self, args, state, control, **kw):
            rec["t_train_end"] = time.time()
            rec["global_step"] = state.global_step
            if cuda:
                rec["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
                rec["peak_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30
            rec["status"] = "trained"
            dump()

    t0 = time.time()
    try:
        trainer = retrofit.train(retro_argv, callbacks=[Recorder()])
        rec["status"] = "ok"
        acc = trainer.accelerator
        rec["accelerate"] = {"distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
                             "mixed_precision": str(acc.mixed_precision), "is_fsdp_enabled": trainer.is_fsdp_enabled,
                             "fsdp_version": getattr(acc.state.fsdp_plugin, "fsdp_version", None)
                             if trainer.is_fsdp_enabled else None, "model_wrapped": type(trainer.model_wrapped).__name__}
    except BaseException as err:  # record, then re-raise so the launcher sees the failure
        rec["status"] = f"error: {type(err).__name__}: {err}"[:2000]
        dump()
        raise
    rec["wall_s"] = time.time() - t0
    dump()


# ----------------------------------------------------------------------------------------------- run
def _run_stage(name, cmd, env, timeout, log):
    """Runs `cmd` in its own process group; on timeout the whole group is terminated."""
    t0 = time.time()
    with open(log, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
    wall = time.time() - t0
    print(f"[{name}] rc={rc} wall={wall:.1f}s (limit {timeout:.0f}s)", flush=True)
    return {"rc": rc, "wall_s": round(wall, 1), "limit_s": timeout}


def retro_args(a, model_dir, out_dir, per_device, grad_acc, train_seconds):
    steps = a.steps
    common = ["--model", str(model_dir), "--dataset", "testbed:reasoning", "--seq_len", str(a.seq_len),
              "--num_examples", str(2 * steps), "--problem_seed", "1234", "--lora_rank", str(a.lora_rank),
              "--dtype", "float32", "--sinks", str(a.sinks), "--window", str(a.window), "--topk", str(a.topk),
              "--scorer", "mlstm", "--output_dir", str(out_dir), "--max_steps", str(steps),
              "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(grad_acc),
              "--learning_rate", "2e-4", "--scorer_learning_rate", "3e-3", "--lr_scheduler_type", "constant",
              "--warmup_steps", "0", "--max_grad_norm", "1.0", "--logging_steps", "1", "--report_to", "none",
              "--save_strategy", "no", "--seed", "0", "--data_seed", "0", "--disable_tqdm", "True",
              "--dataloader_num_workers", "0", "--max_train_seconds", str(train_seconds)]
    if a.device == "cpu":
        common += ["--use_cpu", "--scorer_kwargs", '{"state_dim": 8}']
    else:
        common += ["--bf16"]
    return common


def run(a) -> int:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(a.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    t_start = time.time()
    deadline = t_start + a.seconds
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(key, value)
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
        env.pop("TRITON_INTERPRET", None)
    py = sys.executable
    me = str(Path(__file__).resolve())
    stages, commands = {}, {}

    model_dir = scratch / ("q3_tiny" if a.tiny else f"q3_{a.layers}l")
    cmd = [py, me, "prepare", "--model-dir", str(model_dir), "--layers", str(a.layers), "--device", a.device] + \
        (["--tiny"] if a.tiny else [])
    commands["prepare"] = shlex.join(cmd)
    if (model_dir / "bench_model.json").is_file():
        stages["prepare"] = {"rc": 0, "wall_s": 0.0, "note": "reused"}
    else:
        stages["prepare"] = _run_stage("prepare", cmd, env, min(a.prepare_s, deadline - time.time()), logs / "prepare.log")

    # per-setting: (launcher prefix, per-device batch, grad accumulation, stage limit, extra env)
    if a.device == "cpu":
        torchrun = [py, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        launch = {
            "1gpu": ([py], 1, 2, {}),
            "ddp": (torchrun + ["--master_port", "29541"], 1, 1, {}),
            "fsdp": (torchrun + ["--master_port", "29543"], 1, 1, {}),
        }
        extra = {"1gpu": [], "ddp": ["--ddp_backend", "gloo"],
                 "fsdp": ["--ddp_backend", "gloo", "--fsdp", "full_shard auto_wrap", "--fsdp_config",
                          '{"transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"], "version": 2}']}
    else:
        acc = [py, "-m", "accelerate.commands.launch"]
        launch = {
            "1gpu": ([py], 1, 2, {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}),
            "ddp": (acc + ["--config_file", "training/accelerate_ddp.yaml", "--num_processes", "2",
                           "--main_process_port", "29541"], 1, 1, {}),
            "fsdp": (acc + ["--config_file", "training/accelerate_fsdp.yaml", "--num_processes", "2",
                            "--main_process_port", "29543"], 1, 1, {}),
        }
        extra = {k: [] for k in SETTINGS}
    limits = {"1gpu": a.single_s, "ddp": a.ddp_s, "fsdp": a.fsdp_s}
    for name in a.settings.split(","):
        prefix, per_device, grad_acc, senv = launch[name]
        left = deadline - time.time() - a.report_reserve_s
        limit = min(limits[name], left)
        if limit < 20:
            stages[name] = {"rc": "skipped", "note": f"only {left:.0f}s left"}
            print(f"[{name}] skipped ({left:.0f}s left)", flush=True)
            continue
        # training stops by itself `startup_s` before the stage limit (startup, compile, saving excluded)
        train_s = max(5, int(limit - a.startup_s))
        result = out / "raw" / name
        result.parent.mkdir(exist_ok=True)
        cmd = prefix + [me, "worker", "--result", str(result), "--"] + \
            retro_args(a, model_dir, scratch / "runs" / name, per_device, grad_acc, train_s) + extra[name]
        commands[name] = " ".join(f"{k}={v}" for k, v in senv.items()) + (" " if senv else "") + shlex.join(cmd)
        stages[name] = _run_stage(name, cmd, dict(env, **senv), limit, logs / f"{name}.log")
    meta = {"stages": stages, "commands": commands, "budget_s": a.seconds, "wall_s": round(time.time() - t_start, 1),
            "args": vars(a), "model_dir": str(model_dir)}
    (out / "raw" / "run_meta.json").write_text(json.dumps(meta, indent=1, default=str))
    report(out, a.warmup_steps)
    return 0


# -------------------------------------------------------------------------------------------- report
def _versions():
    from kvpop_lab.utils.provenance import versions

    vers = versions("torch", "transformers", "accelerate", "peft", "triton", missing=lambda err: None)
    try:
        import torch

        if torch.cuda.is_available():
            vers["cuda"] = torch.version.cuda
            vers["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        pass
    return vers


def _summarise(ranks, warmup, seq_len):
    r0 = ranks[0]
    losses = {s["step"]: s["loss"] for s in r0["steps"]}
    argv = r0["argv"]
    get = lambda flag, default: argv[argv.index(flag) + 1] if flag in argv else default  # noqa: E731
    tok_per_gpu_step = int(get("--per_device_train_batch_size", 1)) * int(get("--gradient_accumulation_steps", 1)) * seq_len
    times = r0.get("step_end_times", [])
    dts = [b - a for a, b in zip(times[warmup - 1:], times[warmup:])] if warmup >= 1 and len(times) > warmup else []
    tps = tok_per_gpu_step * len(dts) / sum(dts) if dts else None
    return {
        "status": sorted({r.get("status", "?") for r in ranks}),
        "ranks": len(ranks), "world_size": r0.get("world_size"),
        "steps": max(losses) if losses else 0, "losses": losses,
        "final_loss": losses[max(losses)] if losses else None,
        "tokens_per_gpu_per_step": tok_per_gpu_step,
        "timed_steps": len(dts),
        "step_s_mean": sum(dts) / len(dts) if dts else None,
        "step_s_median": statistics.median(dts) if dts else None,
        "tokens_per_s_per_gpu": tps,
        "tokens_per_s_total": tps * len(ranks) if tps else None,
        "peak_mem_GiB_per_rank": [round(r["peak_mem_GiB"], 2) if r.get("peak_mem_GiB") is not None else None
                                  for r in ranks],
        "peak_reserved_GiB_per_rank": [round(r["peak_reserved_GiB"], 2) if r.get("peak_reserved_GiB") else None
                                       for r in ranks],
        "fsdp_units": r0.get("fsdp_units"), "trainable_params": r0.get("trainable_params"),
        "model_class": r0.get("model_class"), "accelerate": r0.get("accelerate"),
    }


def report(out: Path, warmup: int) -> dict:
    from kvpop_lab.utils.provenance import git_commit

    raw = out / "raw"
    meta = json.loads((raw / "run_meta.json").read_text()) if (raw / "run_meta.json").is_file() else {}
    args = meta.get("args", {})
    seq_len = int(args.get("seq_len", 0))
    model_info = {}
    if meta.get("model_dir") and (Path(meta["model_dir"]) / "bench_model.json").is_file():
        model_info = json.loads((Path(meta["model_dir"]) / "bench_model.json").read_text())
    settings = {}
    for name in SETTINGS:
        ranks = sorted((json.loads(p.read_text()) for p in raw.glob(f"{name}.rank*.json")), key=lambda r: r["rank"])
        if ranks:
            settings[name] = _summarise(ranks, warmup, seq_len)
    ref = settings.get("1gpu", {}).get("losses", {})
    ref_steps = sorted(ref)
    ref_noise = None
    if len(ref_steps) > 2:  # typical step-to-step change of the reference curve, as a noise scale
        ref_noise = statistics.median(abs(ref[b] - ref[a]) for a, b in zip(ref_steps, ref_steps[1:]))
    for name, s in settings.items():
        common = sorted(set(ref) & set(s["losses"]))
        diffs = [abs(s["losses"][k] - ref[k]) for k in common]
        s["common_steps"] = len(common)
        s["max_abs_loss_diff_vs_1gpu"] = max(diffs) if diffs else None
        s["mean_abs_loss_diff_vs_1gpu"] = sum(diffs) / len(diffs) if diffs else None
        s["max_rel_loss_diff_vs_1gpu"] = max(d / max(abs(ref[k]), 1e-12) for d, k in zip(diffs, common)) if diffs else None
    summary = {"commit": git_commit(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               "versions": _versions(), "model": model_info, "warmup_steps_excluded": warmup,
               "ref_step_to_step_median_abs_change": ref_noise, "settings": settings,
               "stages": meta.get("stages"), "commands": meta.get("commands"), "args": args,
               "nccl_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                         "NVSHMEM_DISABLE_NVLS")}}
    (out / "multi_gpu.json").write_text(json.dumps(summary, indent=1, default=str))

    f = lambda v, fmt="{:.4f}": "-" if v is None else fmt.format(v)  # noqa: E731
    lines = ["# KVpop retrofit on several GPUs (DDP / FSDP2 vs one GPU)", "",
             f"- **commit**: {summary['commit']}", f"- **date**: {summary['date_utc']} UTC",
             "- **versions**: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
             f"- **model**: random-init Qwen3 shape {model_info.get('config')}, vocab {model_info.get('vocab_size')}, "
             f"{f(model_info.get('n_params'), '{:,}')} parameters (no pretrained weights)",
             f"- **retrofit**: LoRA rank {args.get('lora_rank')} student, teacher = same weights with adapters off; "
             f"mLSTM scorer; seq_len {seq_len}, sinks {args.get('sinks')} / window {args.get('window')} / topk "
             f"{args.get('topk')}; global batch 2 sequences (1 GPU: batch 1 x grad. accum. 2; 2 GPUs: batch 1 "
             f"per GPU); constant LR, seed 0; loss = boundary + distillation, logged every step (mean over ranks)",
             f"- **timing**: tokens/s per GPU over the steps after the first {warmup} (compile/warm-up excluded); "
             "peak memory = `torch.cuda.max_memory_allocated` per rank", ""]
    lines += ["FSDP units = modules wrapped by `fully_shard` (0: no FSDP; 1: the root only). On CPU accelerate has no "
              "FSDP (MULTI_CPU), so a CPU smoke run's `fsdp` setting runs as DDP (see the accelerate mode column).", ""]
    if ref_noise is not None:
        lines += [f"Noise scale: median |loss change| between consecutive steps of the 1-GPU curve = {ref_noise:.4f}.", ""]
    lines += ["| setting | ranks | steps | final loss | max abs loss diff vs 1 GPU (common steps) | max rel diff | "
              "tokens/s per GPU | step s (median) | peak mem per GPU GiB | FSDP units | accelerate mode | status |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for name in SETTINGS:
        if name not in settings:
            st = (meta.get("stages") or {}).get(name, {})
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | - | - | no result (stage {st}) |")
            continue
        s = settings[name]
        lines.append(f"| {name} | {s['ranks']} | {s['steps']} | {f(s['final_loss'])} | "
                     f"{f(s['max_abs_loss_diff_vs_1gpu'])} ({s['common_steps']}) | {f(s['max_rel_loss_diff_vs_1gpu'], '{:.2%}')} | "
                     f"{f(s['tokens_per_s_per_gpu'], '{:,.0f}')} | {f(s['step_s_median'], '{:.3f}')} | "
                     f"{', '.join(str(m) for m in s['peak_mem_GiB_per_rank'])} | {s['fsdp_units']} | "
                     f"{(s.get('accelerate') or {}).get('distributed_type', '-')} | "
                     f"{'/'.join(s['status'])}; stage rc {(meta.get('stages') or {}).get(name, {}).get('rc')} |")
    lines += ["", "Loss per step:", "", "| step | " + " | ".join(n for n in SETTINGS if n in settings) + " |",
              "|---:|" + "---:|" * len(settings)]
    for k in sorted(set().union(*[s["losses"] for s in settings.values()]) if settings else []):
        lines.append(f"| {k} | " + " | ".join(f(settings[n]["losses"].get(k)) for n in SETTINGS if n in settings) + " |")
    lines += ["", "Commands (run from the repo root with PYTHONPATH=.):", ""]
    for name, cmd in (meta.get("commands") or {}).items():
        lines += [f"- {name}: `{cmd}`"]
    lines += ["", f"Stages: `{json.dumps(meta.get('stages'))}`", ""]
    (out / "multi_gpu.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    _plot(out, settings)
    return summary


def _plot(out, settings):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not settings:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ref = settings.get("1gpu", {}).get("losses", {})
    for name, s in settings.items():
        steps = sorted(s["losses"])
        axes[0].plot(steps, [s["losses"][k] for k in steps], marker=".", label=name)
        common = [k for k in steps if k in ref]
        if name != "1gpu" and common:
            axes[1].plot(common, [s["losses"][k] - ref[k] for k in common], marker=".", label=f"{name} - 1gpu")
    axes[0].set(xlabel="optimizer step", ylabel="loss", title="retrofit loss (global batch 2)")
    axes[1].set(xlabel="optimizer step", ylabel="loss difference", title="difference to the 1-GPU curve")
    axes[1].axhline(0, color="gray", lw=0.5)
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "multi_gpu_loss.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":  # worker -- <retrofit args>: keep the retrofit flags verbatim
        sep = argv.index("--")
        wp = argparse.ArgumentParser()
        wp.add_argument("--result", required=True)
        w = wp.parse_args(argv[1:sep])
        worker(Path(w.result), argv[sep + 1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--model-dir", required=True)
    pp.add_argument("--tiny", action="store_true")
    pp.add_argument("--layers", type=int, default=20)
    pp.add_argument("--device", default="cuda")
    pr = sub.add_parser("run")
    pr.add_argument("--out", required=True)
    pr.add_argument("--scratch", default="/tmp/kvpop_multi_gpu")
    pr.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    pr.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    pr.add_argument("--settings", default=",".join(SETTINGS))
    pr.add_argument("--layers", type=int, default=20)
    pr.add_argument("--seq-len", dest="seq_len", type=int, default=2048)
    pr.add_argument("--steps", type=int, default=30)
    pr.add_argument("--lora-rank", dest="lora_rank", type=int, default=16)
    pr.add_argument("--sinks", type=int, default=4)
    pr.add_argument("--window", type=int, default=128)
    pr.add_argument("--topk", type=int, default=124, help="default: B = 256 = seq_len/8 at 2048")
    pr.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=3)
    pr.add_argument("--seconds", type=float, default=225, help="seconds for the whole run (all stages)")
    pr.add_argument("--prepare-s", dest="prepare_s", type=float, default=45)
    pr.add_argument("--single-s", dest="single_s", type=float, default=75)
    pr.add_argument("--ddp-s", dest="ddp_s", type=float, default=50)
    pr.add_argument("--fsdp-s", dest="fsdp_s", type=float, default=55)
    pr.add_argument("--startup-s", dest="startup_s", type=float, default=30,
                    help="stage time kept for start-up, compilation and saving (training stops earlier by this)")
    pr.add_argument("--report-reserve-s", dest="report_reserve_s", type=float, default=5)
    rp = sub.add_parser("report")
    rp.add_argument("--out", required=True)
    rp.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=3)
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        print(prepare(Path(a.model_dir), a.tiny, a.layers, a.device))
    elif a.cmd == "run":
        return run(a)
    elif a.cmd == "report":
        report(Path(a.out), a.warmup_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
