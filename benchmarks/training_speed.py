"""Per-layer training cost of KVpop vs the dense teacher: sparse forward, transposed target, running top-k.

    # GPU (defaults: Qwen3-0.6B attention shapes, one layer, bf16, S = 4096 and 16384; ~2-3 min on an H200)
    python benchmarks/training_speed.py --out results/training_speed_gpu
    # + full-model numbers (random-init Qwen3 cut to --layers layers): dense teacher vs student forward
    python benchmarks/training_speed.py --out results/training_speed_gpu --full-model --layers 8
    # CPU smoke test (flex runs eagerly, no backward -> (f) skipped)
    python benchmarks/training_speed.py --device cpu --seq-lens 256,512 --heads 4 --kv-heads 2 --head-dim 32 \
        --window 16 --repeats 3 --warmup 1 --full-model --layers 2 --hidden 128 --intermediate 256 --vocab 1000 \
        --out results/training_speed_cpu

Ops, per sequence length S (random q ``[1, H, S, d]``, k/v ``[1, Hkv, S, d]``, priorities ``[1, Hkv, S]``):

  (a)  dense causal attention forward (teacher): ``F.scaled_dot_product_attention(is_causal=True)``, GQA;
  (b)  student sparse forward ``sparse_attention(q, k, v, running_topk(prio), sinks, window)``, both
       excluding ("b") and including ("b+topk") the running top-k; budget B = S / compression,
       topk = B - sinks - window;
  (b0) diagnostic: only the block-mask build of (b) (``sparse_attention_block_mask``: analytic per-block flags
       from rank/cutoff, O(S^2/128) work, no S x S grid);
  (c)  transposed target pass ``future_attention_target(q, k, lse_b, window, backend="flex")``;
  (c0) diagnostic: only the block-mask build of (c) (``future_block_mask_for``: O((S/128)^2) ints);
  (d)  the same target by materialising the S x S probabilities (``future_attention_target_reference``);
  (e)  running top-k on ``[1, Hkv, S]``: Triton Fenwick kernel vs the torch reference;
  (f)  forward + backward of (b) (excluding the top-k, which has no gradient); CUDA only.

Each op: ``--warmup`` calls (the first compiles FlexAttention), one call for peak memory
(``max_memory_allocated`` minus the allocation before the call), then ``--repeats`` timed calls (CUDA
events); the median is reported. Every op is guarded: a failure prints an error row and the rest runs.
Results go to ``<out>.md`` and ``<out>.csv`` with the command line, git commit, versions and device.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import shlex
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from kvpop_hf.ops.dense_attention import expand_kv
from kvpop_lab.utils.provenance import git_commit, versions
from kvpop_lab.utils.timing import compiled_graphs, fmt, free, is_oom, measure, quantiles, sync
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
T_START = time.perf_counter()
warnings.filterwarnings("ignore", message=r".*return_lse.*")
warnings.filterwarnings("ignore", message=r".*past_key_values.*")


# ------------------------------------------------------------------------------------------ provenance
def machine_versions(device: torch.device) -> dict:
    info = versions("torch", "transformers", "triton")
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
        info["gpu_memory_GiB"] = f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.1f}"
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
                         f"{torch.get_num_threads()} torch threads)"
    info["platform"] = platform.platform()
    return info


# ------------------------------------------------------------------------------------------ timing
class Bench:
    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.cuda = device.type == "cuda"

    def sync(self):
        sync(self.device)

    def free(self):
        free(self.device)

    def run(self, fn, warmup=None, repeats=None):
        """-> dict(median_ms, p10_ms, p90_ms, peak_mib, out) where out is the last call's result."""
        warmup = self.warmup if warmup is None else warmup
        repeats = self.repeats if repeats is None else repeats
        out = None
        for _ in range(max(warmup, 0)):
            out = None
            out = fn()
        out = None
        self.sync()
        self.free()
        peak, times, out = measure(fn, self.device, repeats)
        q = quantiles(times)
        return dict(median_ms=q["median"], p10_ms=q["p10"], p90_ms=q["p90"], peak_mib=peak, out=out)


class Recorder:
    """Collects rows; prints each as it lands."""

    COLS = ["section", "op", "S", "median_ms", "p10_ms", "p90_ms", "peak_mib", "ratio_vs_b", "wall_s", "status"]

    def __init__(self):
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.sections: list[tuple[str, float]] = []
        print(f"{'op':<34} {'S':>6} {'median ms':>10} {'peak MiB':>10} {'wall s':>7}  status", flush=True)

    def add(self, section, op, S, res=None, status="ok", wall=float("nan")):
        row = dict(section=section, op=op, S=S, median_ms=float("nan"), p10_ms=float("nan"), p90_ms=float("nan"),
                   peak_mib=float("nan"), ratio_vs_b=float("nan"), wall_s=wall, status=status)
        if res is not None:
            for key in ("median_ms", "p10_ms", "p90_ms", "peak_mib"):
                row[key] = res[key]
        self.rows.append(row)
        print(f"{op:<34} {S:>6} {fmt(row['median_ms'], 3):>10} {fmt(row['peak_mib'], 1):>10} "
              f"{fmt(wall, 1):>7}  {status}", flush=True)
        return row

    def note(self, text):
        self.notes.append(text)
        print(f"  * {text}", flush=True)

    def get(self, op, S):
        for row in self.rows:
            if row["op"] == op and row["S"] == S and row["status"] == "ok":
                return row
        return None


def guarded(rec: Recorder, bench: Bench, section: str, op: str, S: int, fn, **kw):
    """Benchmark fn; on failure record an error row (OOM -> 'OOM') and return None."""
    t0 = time.perf_counter()
    status = "ok"
    try:
        res = bench.run(fn, **kw)
    except Exception as err:  # noqa: BLE001
        res = None
        oom = is_oom(err)
        text = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        status = "OOM" if oom else f"error: {type(err).__name__}: {text}"
        if not oom:
            traceback.print_exc(limit=8)
    if res is None:
        bench.free()  # outside the except block: the traceback (which pins large tensors) is gone by now
    rec.add(section, op, S, res, status, time.perf_counter() - t0)
    return res


# ------------------------------------------------------------------------------------------ attention ops
def dense_sdpa(q, k, v):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except TypeError:  # very old torch without enable_gqa
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, expand_kv(k, g), expand_kv(v, g), is_causal=True)


def layer_section(args, S, device, dtype, bench: Bench, rec: Recorder, state: dict):
    from kvpop_hf.ops.running_topk import running_topk
    from kvpop_hf.ops.sparse_attention import sparse_attention, sparse_attention_block_mask
    from kvpop_hf.ops.targets import (future_attention_target, future_attention_target_reference,
                                           future_block_mask_for)

    sec = f"layer S={S}"
    budget = int(S // args.compression)
    topk = budget - args.sinks - args.window
    if topk < 1:
        rec.note(f"S={S}: budget {budget} <= sinks + window ({args.sinks + args.window}); using topk=1")
        topk = 1
    rec.note(f"S={S}: budget B={budget} (sinks {args.sinks}, window {args.window}, topk {topk}), "
             f"{100 * (1 - budget / S):.1f}% compression")
    gen = torch.Generator(device="cpu").manual_seed(args.seed + S)
    H, Hkv, d = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, H, S, d, generator=gen).to(device, dtype)
    k = torch.randn(1, Hkv, S, d, generator=gen).to(device, dtype)
    v = torch.randn(1, Hkv, S, d, generator=gen).to(device, dtype)
    prio = torch.randn(1, Hkv, S, generator=gen).to(device)
    sinks, window = args.sinks, args.window
    groups = H // Hkv
    tb = args.running_topk

    with torch.no_grad():
        # (a) dense teacher attention
        guarded(rec, bench, sec, "(a) dense sdpa fwd", S, lambda: dense_sdpa(q, k, v))

        # (e) running top-k, both backends (+ agreement check)
        outs = {}
        for backend in ("triton", "torch"):
            if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                rec.add(sec, "(e) running top-k triton", S, None, "skipped: Triton needs CUDA (or TRITON_INTERPRET=1)")
                continue
            res = guarded(rec, bench, sec, f"(e) running top-k {backend}", S,
                          lambda b=backend: running_topk(prio, sinks, window, topk, backend=b))
            if res is not None:
                outs[backend] = res["out"]
        if len(outs) == 2:
            a, b = outs["triton"], outs["torch"]
            same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("rank", "cutoff", "boundary", "keep_new"))
            rec.note(f"S={S}: running top-k triton == torch: {'match' if same else 'MISMATCH'}")
        outs = None
        try:
            plan = running_topk(prio, sinks, window, topk, backend=tb)
        except Exception as err:  # noqa: BLE001
            rec.note(f"S={S}: running_topk(backend={tb!r}) failed ({type(err).__name__}: {err}); using 'torch'")
            plan = running_topk(prio, sinks, window, topk, backend="torch")

        # (b) sparse forward, excluding / including the running top-k
        res_b = guarded(rec, bench, sec, "(b) sparse fwd (excl. top-k)", S,
                        lambda: sparse_attention(q, k, v, plan, sinks, window))

        def b_with_topk():
            p = running_topk(prio, sinks, window, topk, backend=tb)
            return sparse_attention(q, k, v, p, sinks, window)

        guarded(rec, bench, sec, "(b+topk) sparse fwd (incl. top-k)", S, b_with_topk)
        guarded(rec, bench, sec, "(b0) sparse block-mask build only", S,
                lambda: sparse_attention_block_mask(plan, sinks, window, groups))

        if res_b is not None:
            lse = res_b["out"][1].detach()
        else:
            rec.note(f"S={S}: (b) failed; (c)/(d) use the dense causal LSE instead of the sparse one")
            from kvpop_hf.ops.targets import dense_causal_lse
            lse = dense_causal_lse(q, k)
        res_b = None
        bench.free()

        # (c) transposed target pass (flex)
        res_c = guarded(rec, bench, sec, "(c) target pass flex", S,
                        lambda: future_attention_target(q, k, lse, window, backend="flex"))
        guarded(rec, bench, sec, "(c0) target block-mask build only", S,
                lambda: future_block_mask_for(S, window, device))
        if args.chunked_target:
            guarded(rec, bench, sec, "(c-chunked) target pass chunked", S,
                    lambda: future_attention_target(q, k, lse, window, backend="chunked"))
        r_flex = None if res_c is None else res_c["out"]
        res_c = None
        bench.free()

        # (d) materialised reference (S x S float32 maps)
        need = 4 * H * S * S * 4  # scores, exp, where-zeros, where-out (float32)
        if args.skip_reference_above and S > args.skip_reference_above:
            rec.add(sec, "(d) target materialised S x S", S, None, f"skipped (S > {args.skip_reference_above})")
        else:
            if device.type == "cuda":
                try:
                    free_b, _ = torch.cuda.mem_get_info(device)
                    if need > free_b:
                        rec.note(f"S={S}: (d) needs ~{need / 2**30:.1f} GiB, {free_b / 2**30:.1f} GiB free: expect OOM")
                except Exception:  # noqa: BLE001
                    pass
            res_d = guarded(rec, bench, sec, "(d) target materialised S x S", S,
                            lambda: future_attention_target_reference(q, k, lse, window),
                            warmup=min(bench.warmup, 1), repeats=min(bench.repeats, args.reference_repeats))
            if res_d is not None and r_flex is not None:
                r_ref = res_d["out"]
                both = torch.isfinite(r_ref) & torch.isfinite(r_flex)
                diff = (r_ref - r_flex).abs()[both].max().item() if bool(both.any()) else float("nan")
                rec.note(f"S={S}: |target flex - materialised| max = {diff:.3g} (log-space, float32)")
                state.setdefault("target_diff", {})[S] = diff
            res_d = r_ref = None
        r_flex = lse = None
        bench.free()

    # (f) forward + backward of the sparse attention
    if device.type != "cuda" and not args.cpu_backward:
        rec.add(sec, "(f) sparse fwd+bwd (excl. top-k)", S, None,
                "skipped: flex on CPU runs eagerly and has no backward")
    else:
        qg = q.detach().clone().requires_grad_(True)
        kg = k.detach().clone().requires_grad_(True)
        vg = v.detach().clone().requires_grad_(True)
        grad_out = torch.randn_like(q)

        def fwd_bwd():
            qg.grad = kg.grad = vg.grad = None
            out, lse_ = sparse_attention(qg, kg, vg, plan, sinks, window)
            out.backward(grad_out)
            return None

        guarded(rec, bench, sec, "(f) sparse fwd+bwd (excl. top-k)", S, fwd_bwd)
        qg = kg = vg = grad_out = None
    plan = q = k = v = prio = None
    bench.free()


# ------------------------------------------------------------------------------------------ full model
def full_model_section(args, seq_lens, device, dtype, bench: Bench, rec: Recorder):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kvpop_hf.scorers import build_scorer
    from kvpop_hf.trainer.student import TRAIN_ATTN_NAME, StudentSettings, student_forward

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, max_position_embeddings=max(40960, max(seq_lens) + 16),
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    n_params = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    full_equiv = n_params + per_layer * (28 - args.layers) if args.layers < 28 else n_params
    rec.note(f"full model: Qwen3 random init, {args.layers} layers, {n_params / 1e6:.1f}M params "
             f"(28-layer equivalent {full_equiv / 1e6:.1f}M), {dtype}, built in {time.perf_counter() - t0:.1f}s")
    scorer = build_scorer(args.scorer, args.layers, args.kv_heads, args.head_dim).to(device)

    def set_attn(name):
        try:
            model.set_attn_implementation(name)
        except Exception:  # noqa: BLE001
            model.config._attn_implementation = name
            for mod in model.modules():
                if hasattr(mod, "config") and hasattr(mod.config, "_attn_implementation"):
                    mod.config._attn_implementation = name

    for S in seq_lens:
        sec = f"full S={S}"
        budget = int(S // args.compression)
        topk = max(1, budget - args.sinks - args.window)
        settings = StudentSettings(sinks=args.sinks, window=args.window, topk=topk,
                                   backends={"running_topk": args.running_topk})
        gen = torch.Generator(device="cpu").manual_seed(args.seed + 7 * S)
        ids = torch.randint(0, args.vocab, (1, S), generator=gen).to(device)

        set_attn("sdpa")
        with torch.no_grad():
            guarded(rec, bench, sec, "(a') full teacher fwd (sdpa)", S, lambda: model(input_ids=ids).logits,
                    repeats=min(bench.repeats, args.full_repeats))
        bench.free()

        set_attn(TRAIN_ATTN_NAME)

        def student_fwd():
            with torch.no_grad():
                out, record = student_forward(model, scorer, settings, input_ids=ids)
            return out.logits, record

        res = guarded(rec, bench, sec, "(b') full student fwd (kvpop_train)", S, student_fwd,
                      repeats=min(bench.repeats, args.full_repeats))
        if res is not None:
            record = res["out"][1]
            recall = torch.stack([r.float() for r in record.target_recall.values()]).nanmean().item()
            rec.note(f"S={S}: student forward ran {len(record.boundary)} layers; mean teacher top-k "
                     f"recall (random scorer) {recall:.3f}")
        res = None
        bench.free()

        if args.full_backward:
            model.train()

            def student_fwd_bwd():
                model.zero_grad(set_to_none=True)
                scorer.zero_grad(set_to_none=True)
                out, record = student_forward(model, scorer, settings, input_ids=ids)
                loss = torch.stack(list(record.boundary.values())).mean() + out.logits.float().mean()
                loss.backward()
                return None

            guarded(rec, bench, sec, "(f') full student fwd+bwd", S, student_fwd_bwd,
                    repeats=min(bench.repeats, args.full_repeats))
            model.zero_grad(set_to_none=True)
            scorer.zero_grad(set_to_none=True)
            model.eval()
        set_attn("sdpa")
        ids = None
        bench.free()
    model = scorer = None
    bench.free()


# ------------------------------------------------------------------------------------------ analysis / output
def analyse(args, seq_lens, rec: Recorder, state: dict) -> list[str]:
    lines = []
    for row in rec.rows:
        base = rec.get("(b) sparse fwd (excl. top-k)", row["S"])
        if base is not None and row["status"] == "ok" and row["section"].startswith("layer"):
            row["ratio_vs_b"] = row["median_ms"] / base["median_ms"]
    for S in seq_lens:
        b, bt, c = (rec.get("(b) sparse fwd (excl. top-k)", S), rec.get("(b+topk) sparse fwd (incl. top-k)", S),
                    rec.get("(c) target pass flex", S))
        if b is None or c is None:
            lines.append(f"target pass <= 1.5x sparse forward @ S={S}: n/a ((b) or (c) missing)")
            continue
        r = c["median_ms"] / b["median_ms"]
        extra = f"; vs (b+topk) {c['median_ms'] / bt['median_ms']:.2f}x" if bt is not None else ""
        lines.append(f"target pass <= 1.5x sparse forward @ S={S}: {'HOLDS' if r <= 1.5 else 'FAILS'} "
                     f"((c) {c['median_ms']:.2f} ms / (b) {b['median_ms']:.2f} ms = {r:.2f}x{extra})")
    if len(seq_lens) >= 2:
        s0, s1 = min(seq_lens), max(seq_lens)
        ratio_s = s1 / s0
        for op in ("(c) target pass flex", "(b) sparse fwd (excl. top-k)", "(b0) sparse block-mask build only",
                   "(c0) target block-mask build only", "(d) target materialised S x S", "(a) dense sdpa fwd"):
            r0, r1 = rec.get(op, s0), rec.get(op, s1)
            if r0 is None or r1 is None or not (r0["peak_mib"] > 0 and r1["peak_mib"] > 0):
                lines.append(f"memory growth {op}: n/a (not measured at both S={s0} and S={s1}; "
                             "peak memory is CUDA-only)")
                continue
            growth = r1["peak_mib"] / r0["peak_mib"]
            expo = math.log(growth) / math.log(ratio_s)
            label = "target pass memory O(S)" if op.startswith("(c) ") else f"memory growth {op}"
            verdict = "HOLDS" if expo < 1.5 else "FAILS"
            if not op.startswith("(c) "):
                verdict = "~O(S)" if expo < 1.5 else "~O(S^2)"
            lines.append(f"{label}: {verdict} (peak {r0['peak_mib']:.1f} -> {r1['peak_mib']:.1f} MiB for S x{ratio_s:g}: "
                         f"x{growth:.2f}, exponent {expo:.2f}; O(S) = 1, O(S^2) = 2)")
    else:
        lines.append("target pass memory O(S): n/a (needs two sequence lengths)")
    return lines


def write_outputs(args, prefix: str, meta: dict, rec: Recorder, verdicts: list[str]):
    prefix_path = Path(prefix)
    if not prefix_path.is_absolute():
        prefix_path = Path.cwd() / prefix_path
    prefix_path.parent.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = prefix_path.with_name(prefix_path.name + ".csv"), prefix_path.with_name(prefix_path.name + ".md")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        for key, value in meta.items():
            w.writerow([f"# {key}", value])
        w.writerow(Recorder.COLS)
        for row in rec.rows:
            w.writerow([row[c] if not isinstance(row[c], float) else (f"{row[c]:.4f}" if math.isfinite(row[c]) else "")
                        for c in Recorder.COLS])
    md = ["# KVpop training speed (per layer)", ""]
    md += [f"- **{key}**: `{value}`" if key == "command" else f"- **{key}**: {value}" for key, value in meta.items()]
    md += ["", "Ratio: median time over `(b) sparse fwd (excl. top-k)` at the same S. Peak: CUDA "
           "`max_memory_allocated` minus the allocation before the call (inputs excluded, outputs included).", "",
           "| section | op | S | median ms | p10 ms | p90 ms | peak MiB | ratio to (b) | wall s | status |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rec.rows:
        md.append(f"| {r['section']} | {r['op']} | {r['S']} | {fmt(r['median_ms'], 3)} | {fmt(r['p10_ms'], 3)} | "
                  f"{fmt(r['p90_ms'], 3)} | {fmt(r['peak_mib'], 1)} | {fmt(r['ratio_vs_b'], 2)} | "
                  f"{fmt(r['wall_s'], 1)} | {r['status']} |")
    md += ["", "## Checks", ""] + [f"- {v}" for v in verdicts]
    md += ["", "## Notes", ""] + [f"- {n}" for n in rec.notes]
    md += ["", "## Section wall times", ""] + [f"- {name}: {sec:.1f} s" for name, sec in rec.sections]
    md_path.write_text("\n".join(md) + "\n")
    print(f"\nwrote {md_path} and {csv_path}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) | float32 (default on CPU) | float16")
    p.add_argument("--seq-lens", default="4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024, help="full model only")
    p.add_argument("--intermediate", type=int, default=3072, help="full model only")
    p.add_argument("--vocab", type=int, default=151936, help="full model only")
    p.add_argument("--layers", type=int, default=8, help="full model: number of layers (Qwen3-0.6B has 28)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--compression", type=float, default=8.0, help="budget B = S / compression; topk = B - sinks - window")
    p.add_argument("--running-topk", default="auto", choices=("auto", "torch", "wavelet", "triton"),
                   help="Backends.running_topk used inside (b)/(f)/full model (docs/backends.md)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--reference-repeats", type=int, default=5, help="cap on repeats for (d) (S x S maps)")
    p.add_argument("--skip-reference-above", type=int, default=0, help="skip (d) for S above this (0: never skip)")
    p.add_argument("--chunked-target", action="store_true", help="also time the plain-torch chunked target pass")
    p.add_argument("--full-model", action="store_true", help="also time a random-init Qwen3 teacher vs student")
    p.add_argument("--full-backward", action="store_true", help="full model: also time student forward+backward")
    p.add_argument("--full-repeats", type=int, default=5, help="cap on repeats for full-model timings")
    p.add_argument("--scorer", default="mlp", help="full model: scorer for the student (mlp | mlstm | knorm ...)")
    p.add_argument("--cpu-backward", action="store_true", help="try (f) on CPU anyway (expected to fail)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (affects the float32 target passes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/training_speed_gpu", help="output prefix (.md and .csv are added)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available (use --device cpu)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    seq_lens = [int(s) for s in args.seq_lens.replace(" ", "").split(",") if s]
    if args.heads % args.kv_heads:
        sys.exit(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # every (S, grad mode, dtype) is one compiled flex graph; keep dynamo from giving up and falling back
    from kvpop_hf.ops.flex_compiled import recompile_limits

    for name, value in recompile_limits(64).items():  # this script's own process
        setattr(torch._dynamo.config, name, value)

    import kvpop_hf.trainer.student  # noqa: F401  (registers the "kvpop_train" attention)

    meta = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "git_commit": git_commit(REPO), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    meta.update(machine_versions(device))
    meta["dtype"] = dtype_name
    meta["shapes"] = (f"q [1, {args.heads}, S, {args.head_dim}], k/v [1, {args.kv_heads}, S, {args.head_dim}], "
                      f"prio [1, {args.kv_heads}, S] ~ N(0, 1)")
    meta["budget"] = f"B = S/{args.compression:g}, sinks {args.sinks}, window {args.window}, topk = B - sinks - window"
    meta["timing"] = f"warmup {args.warmup}, repeats {args.repeats} (median), (d) repeats <= {args.reference_repeats}"
    meta["tf32"] = str(bool(args.tf32))
    print("\n".join(f"{k_}: {v_}" for k_, v_ in meta.items()), flush=True)
    if device.type == "cpu" and max(seq_lens) > 2048:
        print("warning: large sequence lengths on CPU; pass small sizes (see the docstring)", flush=True)

    bench = Bench(device, args.warmup, args.repeats)
    rec = Recorder()
    state: dict = {}
    for S in seq_lens:
        t0 = time.perf_counter()
        g0 = compiled_graphs()
        try:
            layer_section(args, S, device, dtype, bench, rec, state)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(limit=6)
            rec.note(f"layer section S={S} aborted: {type(err).__name__}: {err}")
            err = None
            bench.free()
        dt = time.perf_counter() - t0
        rec.sections.append((f"layer S={S}", dt))
        rec.note(f"layer section S={S}: {dt:.1f} s wall, {max(compiled_graphs() - g0, 0)} new compiled graphs")
    if args.full_model:
        t0 = time.perf_counter()
        try:
            full_model_section(args, seq_lens, device, dtype, bench, rec)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(limit=6)
            rec.note(f"full-model section aborted: {type(err).__name__}: {err}")
            err = None
            bench.free()
        dt = time.perf_counter() - t0
        rec.sections.append(("full model", dt))
        rec.note(f"full-model section: {dt:.1f} s wall")
    rec.note("priorities are random, so kept tokens are scattered: almost every 128x128 block of (b) is partially "
             "live and flex does near-dense causal work plus mask_mod evaluation; the saving is in the KV cache, "
             "not in these FLOPs")
    rec.note("(b0)/(c0): the library's block-mask builds (analytic per-block flags; no [B, H, S, S] grid as in "
             "create_block_mask, whose eager build was O(S^2) memory: 2.5 GiB at S=4096, 40 GiB at 16384)")
    verdicts = analyse(args, seq_lens, rec, state)
    total = time.perf_counter() - T_START
    rec.sections.append(("total", total))
    print("\n" + "\n".join(verdicts), flush=True)
    print(f"\n{'op':<36} {'S':>6} {'median ms':>10} {'peak MiB':>10} {'ratio (b)':>9}  status")
    for r in rec.rows:
        print(f"{r['op']:<36} {r['S']:>6} {fmt(r['median_ms'], 3):>10} {fmt(r['peak_mib'], 1):>10} "
              f"{fmt(r['ratio_vs_b'], 2):>9}  {r['status']}")
    print("\nsection wall times: " + ", ".join(f"{n} {s:.1f}s" for n, s in rec.sections), flush=True)
    try:
        write_outputs(args, args.out, meta, rec, verdicts)
    except Exception as err:  # noqa: BLE001
        print(f"could not write outputs: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
