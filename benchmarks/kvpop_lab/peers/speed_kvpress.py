"""kvpress's decode speed and memory on the rows of the peers speed table, in kvpress's own environment (kvpress
0.5.5 needs transformers < 5.3); imports nothing of kvpop_hf. The KVpop and StaticCache rows:
``kvpop_lab.peers.speed_ours``; the table: ``kvpop_lab.peers.speed_table``.

    PYTHONPATH=<kvpress site>:benchmarks python -m kvpop_lab.peers.speed_kvpress --device cuda --shape qwen3-8b \\
        --rows 32768x1 131072x1 32768x8 32768x32 --out speed_kvpress.jsonl [--press knorm] [--device-lock DIR]

Per row: random bf16 weights of ``--shape`` (``kvpop_lab.bench.shapes``, the same model as KVpop's rows), random
prompts of ``context`` tokens (batch > 1: every row full length, no padding: kvpress's presses take no padding
mask), ``B = round((1 - --compression) * context)``. Mode ``decoding`` (default): kvpress's
``PrefillDecodingPress`` of ``kvpop_lab.peers.run_kvpress.build``: the prefill press keeps exactly ``B`` of the
prompt per layer and KV head, and a ``DecodingPress(target_size=B, compression_interval=1)`` cuts back to ``B`` after
every step, so the cache holds ``B`` as KVpop's does; mode ``prefill``: the prefill press alone (the cache grows by
one entry a step). Then ``model.generate`` with a ``DynamicCache`` inside the press (greedy, ``--new-tokens``,
eager: kvpress compiles nothing), timed by ``kvpop_lab.bench.step_times.StepTimes``: ``prefill_s`` the call's start
to its first token (the whole prompt in one forward, compressed layer by layer), ``decode_ms`` the median gap after
the second token and ``--warmup`` more, each step synchronised; peaks of allocated memory above the weights up to
the first token and after it. The device is held alone for each whole row (``--device-lock``). A row that runs out
of memory reads ``OOM``. Rows are appended to ``--out`` as they finish.
"""

from __future__ import annotations

import argparse
import time
import traceback
from importlib import metadata

from kvpop_lab.peers.device_lock import DeviceLock
from kvpop_lab.peers.run_kvpress import PRESSES, build
from kvpop_lab.peers.speed_rows import append_row, budget_entries, check_steps, parse_rows, run_stamp
from kvpop_lab.utils.provenance import versions

MODES = ("decoding", "prefill")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSONL the rows are appended to")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", help="a shape of kvpop_lab.bench.shapes (qwen3-8b on the GPU)")
    ap.add_argument("--rows", nargs="+", default=["32768x1", "131072x1", "32768x8", "32768x32"],
                    metavar="CONTEXTxBATCH")
    ap.add_argument("--compression", type=float, default=0.88, help="the budget B = round((1 - c) * context)")
    ap.add_argument("--press", default="knorm", choices=[p for p in PRESSES if p != "dense"])
    ap.add_argument("--mode", default="decoding", choices=MODES)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8, help="tokens after the second one left out of decode_ms")
    ap.add_argument("--device-lock", default=None, metavar="DIR",
                    help="hold the device alone for each row (kvpop_lab.peers.device_lock)")
    return ap


def measure(model, press_name: str, mode: str, context: int, batch: int, budget: int, args, device, lock) -> dict:
    """One row: ``prefill_s``, ``decode_ms``, ``tokens_per_s``, ``first_step_s``, the peaks (GB above the weights)
    and ``entries_end`` (the most entries a layer and head holds at the end), or ``OOM`` / ``error``."""
    import torch
    from transformers import DynamicCache, StoppingCriteriaList

    from kvpop_lab.bench.step_times import StepTimes

    row = {"context": context, "batch": batch, "B": budget, "press": press_name, "mode": mode, "filled": "prefill"}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=g).to(device)
    timer = StepTimes(device)
    cuda = device.type == "cuda"
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cache = None
    try:
        with lock.exclusive():
            press = build(press_name, mode, context, budget)
            cache = DynamicCache()
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with press(model), torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                               past_key_values=cache, stopping_criteria=StoppingCriteriaList([timer]))
    except torch.cuda.OutOfMemoryError as err:
        print(f"kvpress {press_name} ctx {context} batch {batch}: out of memory: {str(err).splitlines()[0][:160]}",
              flush=True)
        return dict(row, **{k: "OOM" for k in ("prefill_s", "decode_ms", "tokens_per_s", "peak_gb", "first_step_s")})
    except Exception as err:
        print(f"kvpress {press_name} ctx {context} batch {batch}: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc(limit=-6)
        return dict(row, **{k: "error" for k in ("prefill_s", "decode_ms", "tokens_per_s", "peak_gb", "first_step_s")})
    finally:
        if cuda:
            torch.cuda.empty_cache()
    decode_ms = timer.decode_ms(args.warmup)
    first = (timer.prefill_peak - weights) if cuda else 0
    after = (torch.cuda.max_memory_allocated(device) - weights) if cuda else 0
    row.update(prefill_s=round(timer.times[0] - start, 3), decode_ms=round(decode_ms, 3),
               tokens_per_s=round(batch * 1000 / decode_ms, 1), first_step_s=round(timer.first_step_s(), 3),
               peak_gb=round(max(first, after) / 1e9, 2), prefill_peak_gb=round(first / 1e9, 2),
               decode_peak_gb=round(after / 1e9, 2), entries_end=max(layer.keys.shape[-2] for layer in cache.layers))
    return row


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    check_steps(args.new_tokens, args.warmup)
    rows = parse_rows(args.rows)
    budgets = {context: budget_entries(args.compression, context) for context, _ in rows}

    import torch
    import transformers

    from kvpop_lab.bench.shapes import build_model

    transformers.utils.logging.set_verbosity_error()  # DecodingPress warns at every press it builds
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, device, dtype, max(c for c, _ in rows) + args.new_tokens + 16)
    with torch.no_grad():  # cuBLAS and the eager kernels start up outside the first row's prefill
        model(torch.ones(1, 256, dtype=torch.long, device=device))
    lock = DeviceLock(args.device_lock)
    common = {"system": "kvpress", "path": f"kvpress {args.press} ({args.mode}), DynamicCache, eager",
              "shape": args.shape, "dtype": str(dtype)[6:],
              "versions": dict(versions("torch", "transformers"), kvpress=metadata.version("kvpress")),
              **run_stamp("kvpop_lab.peers.speed_kvpress", argv, device)}
    for context, batch in rows:
        row = measure(model, args.press, args.mode, context, batch, budgets[context], args, device, lock)
        row.update(common)
        append_row(args.out, row)
        print(f"kvpress ctx {context} batch {batch}: {row['decode_ms']} ms/step, prefill {row['prefill_s']} s, "
              f"peak {row['peak_gb']} GB, entries {row.get('entries_end')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
