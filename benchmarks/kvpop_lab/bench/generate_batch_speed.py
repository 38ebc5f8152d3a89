"""Generated tokens/s and peak memory of ``kvpop_hf.generate_batch`` (continuous batching over ``R`` rows of one
KVpopCache) against static batches through ``model.generate``, on a random-weight model of ``--shape``.

Workload (seed ``--seed``): ``--requests`` prompts of random tokens, lengths uniform in ``[--prompt-min,
--prompt-max]``, each with its own output length uniform in ``[--new-min, --new-max]`` (random weights never stop on
their own, and no EOS is set: every request generates exactly its length). Greedy. Rows (``mode``):

* ``generate_batch``: ``generate_batch(model, requests, cache=KVpopCache(...), max_rows=R)`` for each ``--rows``;
* ``static_kvpop``: the requests in input order, ``--static-batch`` at a time, each batch left-padded, filled by
  ``prefill_in_chunks`` and decoded by ``model.generate(..., custom_generate=run_ahead_sample)`` (the run-ahead loop;
  ``--static-loop stock`` for generate's own) with a KVpopCache of the same budget to the batch's longest output;
* ``static_cache``: the same through ``cache_implementation="static"`` (sdpa attention, the prompt in one
  forward per batch), ``--staticcache-batch`` requests at a time (0: no such rows);
* ``pass_fork`` / ``pass_prefills``: ``--pass-prompts`` prompts (length ``--prompt-max``) with ``--pass-n`` sampled
  outputs of ``--pass-new`` tokens each, through ``generate_batch`` at ``R = --pass-rows``: one prefill forked into
  ``n`` rows (``num_return_sequences``) against ``n`` separate requests of the same prompt (seeds as the fork's).

``tokens_per_s`` = the requests' own output tokens (a static batch's tokens past a request's length are not counted)
over the wall time of the whole mode (prefill included); ``decoded_tokens`` counts every token the model decoded.
``peak_gb``: peak allocated GPU memory above the weights (0 on CPU). An out-of-memory row is written as ``OOM``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]

import kvpop_hf  # noqa: E402,F401  (registers the "kvpop" attention)
from kvpop_hf import KVpopCache, prefill_in_chunks  # noqa: E402
from kvpop_hf.batch import BatchRequest, generate_batch  # noqa: E402
from kvpop_hf.cli.budget_flags import add_budget_flags  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_hf.run_ahead import run_ahead_sample  # noqa: E402
from kvpop_lab.bench.shapes import build_model  # noqa: E402
from kvpop_lab.utils.provenance import git_commit, versions  # noqa: E402

COLUMNS = ["mode", "rows", "requests", "sequences", "tokens", "decoded_tokens", "seconds", "tokens_per_s", "peak_gb",
           "device", "command", "commit", "date"]


def workload(args, vocab: int):
    g = torch.Generator().manual_seed(args.seed)
    prompts, news = [], []
    for _ in range(args.requests):
        n = int(torch.randint(args.prompt_min, args.prompt_max + 1, (), generator=g))
        prompts.append(torch.randint(1, vocab, (n,), generator=g).tolist())
        news.append(int(torch.randint(args.new_min, args.new_max + 1, (), generator=g)))
    return prompts, news


def _cache(model, args):
    return KVpopCache(model.config, sinks=args.sinks, window=args.window, topk=args.topk, scorer=args.scorer)


def _left_padded(prompts, device):
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    return ids.to(device), mask.to(device)


def run_generate_batch(model, args, prompts, news, rows):
    model.set_attn_implementation("kvpop")
    reqs = [BatchRequest(p, max_new_tokens=m) for p, m in zip(prompts, news)]
    res = generate_batch(model, reqs, cache=_cache(model, args), max_rows=rows, do_sample=False,
                         prefill_chunk_size=args.prefill_chunk, progress_bar=args.progress)
    tokens = sum(len(o.generated_tokens) for o in res.values())
    return tokens, tokens


@torch.no_grad()
def run_static(model, args, prompts, news, batch, kind):
    device = next(model.parameters()).device
    tokens = decoded = 0
    for start in range(0, len(prompts), batch):
        ps, ms = prompts[start:start + batch], news[start:start + batch]
        ids, mask = _left_padded(ps, device)
        longest = max(ms)
        gen = dict(attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0)
        if kind == "static_kvpop":
            model.set_attn_implementation("kvpop")
            cache = _cache(model, args)
            prefill_in_chunks(model, cache, ids, args.prefill_chunk, attention_mask=mask)
            if args.static_loop == "run_ahead":
                gen["custom_generate"] = run_ahead_sample
            out = model.generate(ids, **with_cache(model, cache, **gen))
        else:
            model.set_attn_implementation("sdpa")
            out = model.generate(ids, cache_implementation="static", **gen)
        decoded += (out.shape[1] - ids.shape[1]) * len(ps)
        tokens += sum(ms)
        del out
        cache = None
        gc.collect()
    return tokens, decoded


def run_pass(model, args, fork: bool):
    model.set_attn_implementation("kvpop")
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(1, model.config.vocab_size, (args.prompt_max,), generator=g).tolist()
               for _ in range(args.pass_prompts)]
    if fork:
        reqs = [BatchRequest(p, seed=1000 * i, num_return_sequences=args.pass_n) for i, p in enumerate(prompts)]
    else:
        reqs = [BatchRequest(p, seed=1000 * i + j) for i, p in enumerate(prompts) for j in range(args.pass_n)]
    res = generate_batch(model, reqs, cache=_cache(model, args), max_rows=args.pass_rows, do_sample=True,
                         max_new_tokens=args.pass_new, prefill_chunk_size=args.prefill_chunk,
                         progress_bar=args.progress)
    tokens = sum(len(o.generated_tokens) for o in res.values())
    return tokens, tokens


def measure(fn, device, weights):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        tokens, decoded = fn()
    except torch.cuda.OutOfMemoryError as err:
        print(f"out of memory: {str(err).splitlines()[0][:200]}", flush=True)
        traceback.print_exc(limit=-4)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return dict(tokens="OOM", decoded_tokens="OOM", seconds="OOM", tokens_per_s="OOM", peak_gb="OOM")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - weights) / 1e9 if device.type == "cuda" else 0.0
    gc.collect()
    return dict(tokens=tokens, decoded_tokens=decoded, seconds=round(seconds, 2),
                tokens_per_s=round(tokens / seconds, 1), peak_gb=round(peak, 2))


def run_rows(args, command: str) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_model(args.shape, device, dtype, args.prompt_max + max(args.new_max, args.pass_new) + 16)
    model.generation_config.eos_token_id = None
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    prompts, news = workload(args, model.config.vocab_size)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    common = dict(device=gpu, command=command, commit=git_commit(ROOT),
                  date=f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}")
    plan = [(f"generate_batch", r, args.requests, args.requests,
             lambda r=r: run_generate_batch(model, args, prompts, news, r)) for r in args.rows]
    if args.static_batch:
        plan.append(("static_kvpop", args.static_batch, args.requests, args.requests,
                     lambda: run_static(model, args, prompts, news, args.static_batch, "static_kvpop")))
    if args.staticcache_batch:
        plan.append(("static_cache", args.staticcache_batch, args.requests, args.requests,
                     lambda: run_static(model, args, prompts, news, args.staticcache_batch, "static_cache")))
    if args.pass_prompts:
        seqs = args.pass_prompts * args.pass_n
        plan += [("pass_fork", args.pass_rows, args.pass_prompts, seqs, lambda: run_pass(model, args, True)),
                 ("pass_prefills", args.pass_rows, seqs, seqs, lambda: run_pass(model, args, False))]
    rows = []
    for mode, r, requests, sequences, fn in plan:
        row = dict(mode=mode, rows=r, requests=requests, sequences=sequences, **measure(fn, device, weights),
                   **common)
        print(f"{mode} rows={r}: {row['tokens']} tokens in {row['seconds']} s = {row['tokens_per_s']} tok/s, "
              f"peak {row['peak_gb']} GB", flush=True)
        rows.append(row)
        if args.out_prefix:
            write(Path(args.out_prefix), rows)  # kept if the call is killed
    return rows


def write(prefix: Path, rows: list[dict]) -> list[Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    csv_path = prefix.with_suffix(".csv")
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)
    shown = [c for c in COLUMNS if c not in ("device", "command", "commit", "date")]
    first = rows[0] if rows else {}
    lines = [f"# generate_batch against static batches ({first.get('device', '')})", "",
             f"- command: `{first.get('command', '')}`", f"- commit: {first.get('commit', '')}",
             f"- date: {first.get('date', '')}",
             f"- versions: {json.dumps(versions('torch', 'transformers', 'triton'))}", "",
             "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in shown) + " |" for r in rows]
    md = prefix.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    return [csv_path, md]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--scorer", default="knorm")
    add_budget_flags(ap, sinks=4, window=256, topk=3836)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=4096)
    ap.add_argument("--prompt-max", type=int, default=16384)
    ap.add_argument("--new-min", type=int, default=256)
    ap.add_argument("--new-max", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64], help="R of the generate_batch rows")
    ap.add_argument("--static-batch", type=int, default=32, help="static KVpopCache batches (0: none)")
    ap.add_argument("--static-loop", default="run_ahead", choices=["run_ahead", "stock"])
    ap.add_argument("--staticcache-batch", type=int, default=0, help="StaticCache batches (0: none)")
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--pass-prompts", type=int, default=8, help="prompts of the pass@n rows (0: none)")
    ap.add_argument("--pass-n", type=int, default=16)
    ap.add_argument("--pass-new", type=int, default=1024)
    ap.add_argument("--pass-rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true", help="tqdm bars of generate_batch")
    ap.add_argument("--out-prefix", default=None)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if not (1 <= args.prompt_min <= args.prompt_max and 1 <= args.new_min <= args.new_max):
        raise ValueError("need 1 <= --prompt-min <= --prompt-max and 1 <= --new-min <= --new-max")
    command = "python benchmarks/generate_batch_speed.py " + " ".join(argv)
    rows = run_rows(args, command)
    if args.out_prefix:
        for path in write(Path(args.out_prefix), rows):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
