"""Decode speed and memory measured through ``model.generate`` exactly as a user calls it.

Run as ``python benchmarks/generate_call_speed.py ...``. Per (cache,
scorer, context, batch) on a random-weight model of ``--shape``:

* ``kvpop``: ``KVpopCache(model.config, sinks, window, topk, scorer)`` filled by
  ``kvpop_hf.prefill_in_chunks(model, cache, ids, --prefill-chunk, attention_mask)``, then
  ``model.generate(ids, attention_mask=..., cache=cache, max_new_tokens=N)`` (attention ``"kvpop"``);
* ``static``: ``model.generate(ids, attention_mask=..., cache_implementation="static", max_new_tokens=N)``
  (attention ``"sdpa"``, the prompt in one forward).

Greedy, ``min_new_tokens = max_new_tokens = --new-tokens``; the decode step is compiled by transformers' default
(on CUDA, for a compileable cache). Batch > 1: prompts left-padded to the context, real lengths spread evenly
over ``[context/2, context]``. A stopping criterion records the (synchronised) time after every new token:
``first_step_s`` is the gap between the first token (end of prefill) and the second (the first compiled step,
compilation included), ``decode_ms`` the median gap after ``--warmup`` more tokens, ``tokens_per_s = batch *
1000 / decode_ms``, ``peak_gb`` the peak of allocated GPU memory during the call above the weights (0 on CPU).
A row that runs out of memory is written with ``OOM``; a row whose ``generate`` fails otherwise (e.g. an inductor
error) is written with ``error`` and the failure printed, after ``torch._dynamo.reset()`` and one retry (see
``--no-retry``).

``--synthetic-from N``: rows of batch >= N skip the prefill and fill the cache in place with random keys and
values (the state ``prefill_in_chunks`` leaves: every row holds its real tokens but the last, KVpop's slot layout
per row, StaticCache's ``context - 1`` positions), then call ``generate`` the same way: decode speed and memory do
not depend on the contents, and a 32k prefill of 128 rows would take minutes. Their ``peak_gb`` is the decode's
(the prompt is not run). ``--static-contexts`` limits the StaticCache rows to some contexts. ``--compile-mode max-autotune``
passes ``compile_config=CompileConfig(mode="max-autotune")`` to ``generate`` (inductor tunes the matrix products;
CUDA graphs stay on). ``--projections separate fused`` measures every row again after
``kvpop_hf.ops.fused_projections.fuse_projection_storage(model)`` with ``compile_config=fused_compile_config(mode)``
(q/k/v and gate/up as one matrix product each in the compiled step). ``--profile-dir``
writes a torch.profiler table (CPU and CUDA time) of three decode steps inside ``generate`` per (cache, scorer)
at batch 1 and the first context, and the log prints each row's count of non-static CUDA-graph inputs.

``--compile-reuse DIR``: the whole measurement runs twice, in two fresh processes one after the other, both
calling ``kvpop_hf.compile_cache.enable_compile_cache(DIR)`` first (the first one also saves the portable bundle
at its end): the rows say ``process`` ``first`` / ``second``. CSV columns:
``cache,scorer,context,batch,decode_ms,tokens_per_s,peak_gb,first_step_s,process``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import itertools
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import CompileConfig, StaticCache, StoppingCriteriaList

ROOT = Path(__file__).resolve().parents[3]

import kvpop_hf  # noqa: E402,F401  (registers the "kvpop" attention)
from kvpop_hf import KVpopCache, prefill_in_chunks  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_hf.cli.budget_flags import add_budget_flags  # noqa: E402
from kvpop_hf.compile_cache import enable_compile_cache, save_compile_cache  # noqa: E402
from kvpop_hf.ops.fused_projections import fuse_projection_storage, fused_compile_config  # noqa: E402
from kvpop_hf.run_ahead import run_ahead_sample  # noqa: E402
from kvpop_lab.utils.provenance import git_commit, versions  # noqa: E402
from kvpop_lab.bench.generation_speed import build_model, fill_dense, fill_kvpop  # noqa: E402
from kvpop_lab.bench.step_times import StepTimes  # noqa: E402

COLUMNS = ["cache", "scorer", "context", "batch", "decode_ms", "tokens_per_s", "peak_gb", "first_step_s", "process"]


def prompts(batch: int, context: int, vocab: int, device, seed: int = 0):
    """(ids, attention_mask) ``[batch, context]``: random tokens, left padding, real lengths in ``[context/2,
    context]`` (row 0 the longest)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, context), generator=g)
    lengths = [context - (i * (context // 2)) // max(batch - 1, 1) for i in range(batch)] if batch > 1 else [context]
    mask = torch.zeros(batch, context, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, context - n:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)


def fill_static_in_place(model, batch: int, context: int, extra: int, device):
    """A StaticCache of ``context + extra`` positions holding ``context - 1`` random ones (padding positions
    included, as after generate's prefill; the attention mask hides them)."""
    cache = fill_dense("static", model, batch, context - 1, extra + 1, device, model.dtype)
    if int(cache.get_seq_length()) != context - 1:
        raise RuntimeError("this transformers' StaticCache does not report the filled length; drop --synthetic-from")
    return cache


@torch.no_grad()  # the in-place fills run a forward: with autograd on it would keep every layer's expanded K/V
def generate_once(model, cache_kind: str, scorer: str, ids, mask, gen: dict, args, synthetic: bool) -> None:
    cache = None
    try:
        if cache_kind == "kvpop":
            model.set_attn_implementation("kvpop")
            cache = KVpopCache(model.config, sinks=args.sinks, window=args.window, topk=args.topk, scorer=scorer)
            if synthetic:
                fill_kvpop(cache, model, mask)
            else:
                prefill_in_chunks(model, cache, ids, args.prefill_chunk, attention_mask=mask)
            model.generate(ids, **with_cache(model, cache, **gen))
        else:
            model.set_attn_implementation("sdpa")
            if synthetic:
                cache = fill_static_in_place(model, ids.shape[0], ids.shape[1], args.new_tokens + 16, ids.device)
                model.generate(ids, **with_cache(model, cache, **gen))
            elif gen.get("custom_generate") is not None:
                # what cache_implementation="static" builds, as an object: a custom decoding loop takes the cache
                cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + args.new_tokens + 16)
                model.generate(ids, **with_cache(model, cache, **gen))
            else:
                model.generate(ids, cache_implementation="static", **gen)
    finally:
        cache = None
        gc.collect()


def non_static_inputs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_recorded_non_static_inputs", 0))


def measure(model, cache_kind: str, scorer: str, context: int, batch: int, args, device, profile_to=None,
            loop: str = "stock", projections: str = "separate", lock=None, lock_whole: bool = False) -> dict:
    """One row (see the module docstring). Beside the CSV's columns the row holds ``prefill_s`` (the call's start to
    its first token: cache, prefill and the first forward; rows filled in place have none), ``prefill_peak_gb`` and
    ``decode_peak_gb`` (above the weights, up to the first token and after it).

    ``lock`` (``kvpop_lab.peers.device_lock.DeviceLock``): the device is taken from the processes sharing it for the
    prefill (up to the first token) and for the decode steps after the first compiled one; the compilation in
    between runs while they go on. ``lock_whole``: taken for the whole call (a row too large to share the memory)."""
    row = {"cache": cache_kind, "scorer": scorer if cache_kind == "kvpop" else "", "context": context,
           "batch": batch, "process": args.process, "loop": loop, "projections": projections}
    synthetic = args.synthetic_from is not None and batch >= args.synthetic_from
    ids, mask = prompts(batch, context, model.config.vocab_size, device)
    between = {} if lock is None or lock_whole else {1: lock.release, 2: lock.acquire}
    timer = StepTimes(device, profile_at=args.warmup + 2 if profile_to else None, sync_all=loop == "stock",
                      on_token=between)
    gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
               do_sample=False, stopping_criteria=StoppingCriteriaList([timer]), pad_token_id=0)
    if loop == "run_ahead":
        gen["custom_generate"] = run_ahead_sample
    if projections == "fused":
        gen["compile_config"] = fused_compile_config(args.compile_mode)
    elif args.compile_mode:
        gen["compile_config"] = CompileConfig(mode=args.compile_mode)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    inputs_before = non_static_inputs()
    for attempt in range(1 if args.no_retry else 2):
        if lock is not None:
            lock.acquire()
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            generate_once(model, cache_kind, scorer, ids, mask, gen, args, synthetic)
            break
        except torch.cuda.OutOfMemoryError as err:
            row.update(decode_ms="OOM", tokens_per_s="OOM", peak_gb="OOM", first_step_s="OOM")
            timer.stop_profile()
            where = traceback.extract_tb(err.__traceback__)[-1]
            print(f"[{args.process}] {cache_kind} {scorer or '-'} ctx {context} batch {batch} out of memory at "
                  f"{Path(where.filename).name}:{where.lineno} ({where.name}): {str(err).splitlines()[0][:160]}",
                  flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return row
        except Exception as err:  # e.g. torch._inductor.exc.InductorError: shown, then one retry after a reset
            timer.stop_profile()
            print(f"[{args.process}] {cache_kind} {scorer or '-'} ctx {context} batch {batch} attempt {attempt + 1}: "
                  f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", flush=True)
            traceback.print_exc(limit=-6)
            torch._dynamo.reset()
            timer.times.clear()
            if attempt == (0 if args.no_retry else 1):
                row.update(decode_ms="error", tokens_per_s="error", peak_gb="error", first_step_s="error")
                return row
            print(f"[{args.process}] retrying after torch._dynamo.reset()", flush=True)
        finally:
            if lock is not None:
                lock.release()
    row["non_static_inputs"] = non_static_inputs() - inputs_before
    row["synthetic"] = synthetic
    if profile_to and timer.profile is not None:
        Path(profile_to).write_text(timer.profile)
    decode_ms = timer.decode_ms(args.warmup)
    if device.type == "cuda":
        first, after = timer.prefill_peak - weights, torch.cuda.max_memory_allocated(device) - weights
    else:
        first = after = 0
    row.update(decode_ms=round(decode_ms, 3), tokens_per_s=round(batch * 1000 / decode_ms, 1),
               peak_gb=round(max(first, after) / 1e9, 2), first_step_s=round(timer.first_step_s(), 2),
               prefill_s=None if synthetic else round(timer.times[0] - start, 3),
               prefill_peak_gb=round(first / 1e9, 2), decode_peak_gb=round(after / 1e9, 2))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _rows_of(model, args, device, projections: str, done: list[dict]) -> list[dict]:
    """The rows of one projections setting; ``done``: the rows measured before, written with the partial results."""
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for kind in args.caches:
                for scorer in (args.scorers if kind == "kvpop" else [""]):
                    if kind == "static" and (batch > args.static_max_batch or (
                            args.static_contexts is not None and context not in args.static_contexts) or (
                            args.static_batches is not None and batch not in args.static_batches)):
                        continue
                    if kind == "kvpop" and args.kvpop_batches is not None and batch not in args.kvpop_batches:
                        continue
                    for loop in args.loops:
                        profile_to = None
                        if args.profile_dir and batch == 1 and context == args.contexts[0]:
                            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
                            profile_to = (Path(args.profile_dir)
                                          / f"profile_{args.process}_{kind}_{scorer or 'dense'}_{loop}_{projections}.txt")
                        row = measure(model, kind, scorer, context, batch, args, device, profile_to, loop, projections)
                        print(f"[{args.process}] {kind} {scorer or '-'} ctx {context} batch {batch} {loop} {projections}: "
                              f"{row['decode_ms']} ms/step, {row['tokens_per_s']} tok/s, peak {row['peak_gb']} GB, "
                              f"first step {row['first_step_s']} s, non-static graph inputs "
                              f"{row.get('non_static_inputs', '-')}"
                              + (" (filled in place)" if row.get("synthetic") else ""), flush=True)
                        rows.append(row)
                        if args.out_prefix and not args.rows_json:
                            write(Path(args.out_prefix), done + rows,
                                  "(partial) " + " ".join(sys.argv))  # kept if killed
    return rows


def run_rows(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.compile_reuse:  # one of the two processes of --compile-reuse
        state = enable_compile_cache(args.compile_reuse)
        print(f"[{args.process}] compile cache {state['directory']}: {state['loaded']} artifacts loaded", flush=True)
    model = build_model(args.shape, device, dtype, max(args.contexts) + args.new_tokens + 16)
    rows = []
    for projections in args.projections:
        if projections == "fused":  # in place and for good: the fused rows come after the separate ones
            groups = fuse_projection_storage(model)
            torch._dynamo.reset()
            print(f"[{args.process}] projections fused: {groups} groups (q/k/v, gate/up) in one buffer each",
                  flush=True)
        rows += _rows_of(model, args, device, projections, done=rows)
    if args.compile_reuse and args.process == "first":
        save_compile_cache(args.compile_reuse)
    return rows


MD_COLUMNS = COLUMNS + ["loop", "projections", "filled", "non_static_inputs"]
RUN_AHEAD_SUFFIX = "_run_ahead"  # the run-ahead rows' CSV: <prefix>_run_ahead.csv, the same columns
FUSED_SUFFIX = "_fused"  # rows with --projections fused: <prefix>_fused.csv / <prefix>_run_ahead_fused.csv


def _md_cell(row: dict, key: str) -> str:
    if key == "filled":
        return "" if "synthetic" not in row else ("in place" if row["synthetic"] else "prefill")
    return str(row.get(key, ""))


def write(prefix: Path, rows: list[dict], command: str) -> list[Path]:
    """The CSV files (one per loop and projections) and the Markdown table; returns the paths written."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for loop, projections in itertools.product(("stock", "run_ahead"), ("separate", "fused")):
        path = prefix.with_name(prefix.name + (RUN_AHEAD_SUFFIX if loop == "run_ahead" else "")
                                + (FUSED_SUFFIX if projections == "fused" else "") + ".csv")
        mine = [r for r in rows if r.get("loop", "stock") == loop and r.get("projections", "separate") == projections]
        if not mine:
            continue
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows({k: r.get(k, "") for k in COLUMNS} for r in mine)
        written.append(path)
    vers = versions("torch", "transformers", "triton")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    lines = [f"# Decode through model.generate ({gpu})", "",
             f"- command: `{command}`", f"- commit: {git_commit(ROOT)}",
             f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- versions: {json.dumps(vers)}", "",
             "- `filled`: `prefill` (the prompt run by prefill_in_chunks or generate) or `in place` (--synthetic-from: "
             "random contents, decode only); `non_static_inputs`: CUDA-graph inputs copied at every replay", "",
             "| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    lines += ["| " + " | ".join(_md_cell(r, k) for k in MD_COLUMNS) + " |" for r in rows]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return written + [prefix.with_suffix(".md")]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--caches", nargs="+", default=["static", "kvpop"], choices=["static", "kvpop"])
    ap.add_argument("--scorers", nargs="+", default=["knorm", "mlp", "mlstm"])
    add_budget_flags(ap, sinks=4, window=256, topk=3836)
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8, help="tokens after the first compiled step left out of decode_ms")
    ap.add_argument("--static-max-batch", type=int, default=1 << 30, help="skip StaticCache rows above this batch")
    ap.add_argument("--static-contexts", type=int, nargs="+", default=None,
                    help="StaticCache rows at these contexts only (default: all)")
    ap.add_argument("--static-batches", type=int, nargs="+", default=None,
                    help="StaticCache rows at these batch sizes only (default: all of --batches)")
    ap.add_argument("--kvpop-batches", type=int, nargs="+", default=None,
                    help="KVpopCache rows at these batch sizes only (default: all of --batches)")
    ap.add_argument("--synthetic-from", type=int, default=None, metavar="BATCH",
                    help="rows of batch >= BATCH fill the cache in place instead of running the prompt")
    ap.add_argument("--profile-dir", default=None, help="profile three decode steps per (cache, scorer) at batch 1")
    ap.add_argument("--compile-mode", default=None, choices=["reduce-overhead", "max-autotune"],
                    help="generate's compile_config=CompileConfig(mode=...) (default: transformers' own config)")
    ap.add_argument("--loops", nargs="+", default=["stock"], choices=["stock", "run_ahead"],
                    help="decoding loops per row: generate's own (stock) and/or custom_generate=run_ahead_sample "
                         "(kvpop_hf.run_ahead; its rows go to <out-prefix>_run_ahead.csv)")
    ap.add_argument("--projections", nargs="+", default=["separate"], choices=["separate", "fused"],
                    help="fused: every row again after kvpop_hf.ops.fused_projections.fuse_projection_storage(model), "
                         "compiled with fused_compile_config (rows to <out-prefix>[_run_ahead]_fused.csv)")
    ap.add_argument("--no-retry", action="store_true", help="a failed generate is not retried after a dynamo reset")
    ap.add_argument("--compile-reuse", metavar="DIR", default=None,
                    help="run everything in two fresh processes sharing the compile cache DIR (process first/second)")
    ap.add_argument("--process", default="first", choices=["first", "second"], help=argparse.SUPPRESS)
    ap.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-prefix", default=None)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.projections = sorted(set(args.projections), key=["separate", "fused"].index)  # fusing is for good
    if args.new_tokens < args.warmup + 3:
        raise ValueError(f"--new-tokens {args.new_tokens} leaves no timed step after --warmup {args.warmup}: "
                         f"use --new-tokens >= {args.warmup + 3}.")
    command = "python benchmarks/generate_call_speed.py " + " ".join(argv)
    if args.rows_json:  # one process of --compile-reuse: rows to the parent, nothing written
        Path(args.rows_json).write_text(json.dumps(run_rows(args)))
        return 0
    if args.compile_reuse:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for label in ("first", "second"):
                out = Path(tmp) / f"{label}.json"
                subprocess.run([sys.executable, "-m", "kvpop_lab.bench.generate_call_speed", *argv, "--process", label, "--rows-json", str(out)], check=True)
                rows += json.loads(out.read_text())
    else:
        rows = run_rows(args)
    if args.out_prefix:
        for path in write(Path(args.out_prefix), rows, command):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
