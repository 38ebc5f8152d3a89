"""Decode speed and memory measured through ``model.generate`` exactly as a user calls it.

Run as ``python benchmarks/generation_speed.py --via-generate ...`` (or this file directly). Per (cache,
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
A row that runs out of memory is written with ``OOM``.

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
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kvpop_hf  # noqa: E402,F401  (registers the "kvpop" attention)
from kvpop_hf import KVpopCache, prefill_in_chunks  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_hf.compile_cache import enable_compile_cache, save_compile_cache  # noqa: E402
from kvpop_hf.utils.provenance import git_commit, versions  # noqa: E402

COLUMNS = ["cache", "scorer", "context", "batch", "decode_ms", "tokens_per_s", "peak_gb", "first_step_s", "process"]


class StepTimes(StoppingCriteria):
    """Records the time after each generated token (after a device synchronisation); never stops generation."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


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


def measure(model, cache_kind: str, scorer: str, context: int, batch: int, args, device) -> dict:
    """One row (see the module docstring)."""
    row = {"cache": cache_kind, "scorer": scorer if cache_kind == "kvpop" else "", "context": context,
           "batch": batch, "process": args.process}
    ids, mask = prompts(batch, context, model.config.vocab_size, device)
    timer = StepTimes(device)
    gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
               do_sample=False, stopping_criteria=StoppingCriteriaList([timer]), pad_token_id=0)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        if cache_kind == "kvpop":
            model.set_attn_implementation("kvpop")
            sinks, window, topk = args.budget
            cache = KVpopCache(model.config, sinks=sinks, window=window, topk=topk, scorer=scorer)
            prefill_in_chunks(model, cache, ids, args.prefill_chunk, attention_mask=mask)
            model.generate(ids, **with_cache(model, cache, **gen))
        else:
            model.set_attn_implementation("sdpa")
            model.generate(ids, cache_implementation="static", **gen)
    except torch.cuda.OutOfMemoryError:
        row.update(decode_ms="OOM", tokens_per_s="OOM", peak_gb="OOM", first_step_s="OOM")
        return row
    finally:
        cache = None
        gc.collect()
    t = timer.times
    if len(t) < args.warmup + 3:
        raise ValueError(f"{len(t)} tokens timed: raise --new-tokens above --warmup + 2")
    gaps = [b - a for a, b in zip(t[1 + args.warmup:], t[2 + args.warmup:])]
    decode_ms = 1000 * statistics.median(gaps)
    peak = (torch.cuda.max_memory_allocated(device) - weights) / 1e9 if device.type == "cuda" else 0.0
    row.update(decode_ms=round(decode_ms, 3), tokens_per_s=round(batch * 1000 / decode_ms, 1),
               peak_gb=round(peak, 2), first_step_s=round(t[1] - t[0], 2))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_rows(args) -> list[dict]:
    from generation_speed import build_model

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.compile_reuse:  # one of the two processes of --compile-reuse
        state = enable_compile_cache(args.compile_reuse)
        print(f"[{args.process}] compile cache {state['directory']}: {state['loaded']} artifacts loaded", flush=True)
    model = build_model(args.shape, device, dtype, max(args.contexts) + args.new_tokens + 16)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for kind in args.caches:
                for scorer in (args.scorers if kind == "kvpop" else [""]):
                    if kind == "static" and batch > args.static_max_batch:
                        continue
                    row = measure(model, kind, scorer, context, batch, args, device)
                    print(f"[{args.process}] {kind} {scorer or '-'} ctx {context} batch {batch}: "
                          f"{row['decode_ms']} ms/step, {row['tokens_per_s']} tok/s, peak {row['peak_gb']} GB, "
                          f"first step {row['first_step_s']} s", flush=True)
                    rows.append(row)
    if args.compile_reuse and args.process == "first":
        save_compile_cache(args.compile_reuse)
    return rows


def write(prefix: Path, rows: list[dict], command: str) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(prefix.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)
    vers = versions("torch", "transformers", "triton")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    lines = [f"# Decode through model.generate ({gpu})", "",
             f"- command: `{command}`", f"- commit: {git_commit(ROOT)}",
             f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- versions: {json.dumps(vers)}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in COLUMNS) + " |" for r in rows]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--caches", nargs="+", default=["static", "kvpop"], choices=["static", "kvpop"])
    ap.add_argument("--scorers", nargs="+", default=["knorm", "mlp", "mlstm"])
    ap.add_argument("--budget", type=int, nargs=3, default=[4, 256, 3836], metavar=("SINKS", "WINDOW", "TOPK"))
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8, help="tokens after the first compiled step left out of decode_ms")
    ap.add_argument("--static-max-batch", type=int, default=1 << 30, help="skip StaticCache rows above this batch")
    ap.add_argument("--compile-reuse", metavar="DIR", default=None,
                    help="run everything in two fresh processes sharing the compile cache DIR (process first/second)")
    ap.add_argument("--process", default="first", choices=["first", "second"], help=argparse.SUPPRESS)
    ap.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-prefix", default=None)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.new_tokens < args.warmup + 3:
        raise ValueError(f"--new-tokens {args.new_tokens} leaves no timed step after --warmup {args.warmup}: "
                         f"use --new-tokens >= {args.warmup + 3}.")
    command = "python benchmarks/generation_speed.py --via-generate " + " ".join(argv)
    if args.rows_json:  # one process of --compile-reuse: rows to the parent, nothing written
        Path(args.rows_json).write_text(json.dumps(run_rows(args)))
        return 0
    if args.compile_reuse:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for label in ("first", "second"):
                out = Path(tmp) / f"{label}.json"
                subprocess.run([sys.executable, __file__, *argv, "--process", label, "--rows-json", str(out)], check=True)
                rows += json.loads(out.read_text())
    else:
        rows = run_rows(args)
    if args.out_prefix:
        write(Path(args.out_prefix), rows, command)
        print(f"wrote {Path(args.out_prefix).with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
