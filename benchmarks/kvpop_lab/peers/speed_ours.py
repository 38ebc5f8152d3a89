"""KVpop's fastest documented decode path and transformers' StaticCache + torch.compile on the rows of the peers
speed table, one system per process (the kvpress row: ``kvpop_lab.peers.speed_kvpress``; the table:
``kvpop_lab.peers.speed_table``).

    python -m kvpop_lab.peers.speed_ours --system kvpop --device cuda --shape qwen3-8b \\
        --rows 32768x1 131072x1 32768x8 32768x32 --out speed_kvpop.jsonl [--device-lock DIR]

* ``kvpop``: ``KVpopCache`` with the knorm scorer at ``B = round((1 - --compression) * context)`` entries per layer
  and KV head (4 sinks, a 64-token window, ``B - 68`` long-range slots), the prompt through
  ``kvpop_hf.prefill_in_chunks`` in ``--prefill-chunk`` token chunks, then
  ``generate(custom_generate=kvpop_hf.run_ahead_sample)`` with q/k/v and gate/up fused
  (``fuse_projection_storage`` + ``fused_compile_config``): the path of the fastest rows of
  ``results/speed_generate_h200.csv``.
* ``static``: ``generate(cache_implementation="static")``: a StaticCache of the whole context, the decode step
  compiled by generate's default (CUDA graphs), generate's own loop.

Each row is ``kvpop_lab.bench.generate_call_speed.measure``: random bf16 weights of ``--shape``, greedy,
``--new-tokens`` tokens, ``decode_ms`` the median gap after the first compiled step and ``--warmup`` more (each step
synchronised; host gaps of the run-ahead loop), ``prefill_s`` the call's start to its first token, peaks above the
weights. Batch > 1: left-padded prompts (real lengths spread over ``[context/2, context]``), and rows of batch
``>= --synthetic-from`` fill the cache in place (random contents, decode only, no ``prefill_s``). A row that runs
out of memory reads ``OOM``. ``torch._dynamo.reset()`` between rows: each row's decode step is compiled for its
own shapes, as in a process of its own (no row runs a dynamic-shape graph that dynamo would build after a second
shape). Rows are appended to ``--out`` as they finish.
"""

from __future__ import annotations

import argparse
import gc

from kvpop_lab.peers.speed_rows import append_row, budget_entries, check_steps, parse_rows, run_stamp

SYSTEMS = {"kvpop": "KVpopCache knorm, prefill_in_chunks, run_ahead_sample, fused projections, compiled decode",
           "static": "StaticCache (full context), generate's compiled decode"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    ap.add_argument("--out", required=True, help="JSONL the rows are appended to")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", help="a shape of kvpop_lab.bench.shapes (qwen3-8b on the GPU)")
    ap.add_argument("--rows", nargs="+", default=["32768x1", "131072x1", "32768x8", "32768x32"],
                    metavar="CONTEXTxBATCH")
    ap.add_argument("--compression", type=float, default=0.88, help="KVpop's budget B = round((1 - c) * context)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--scorer", default="knorm")
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8, help="tokens after the first compiled step left out of decode_ms")
    ap.add_argument("--synthetic-from", type=int, default=8, metavar="BATCH",
                    help="rows of batch >= BATCH fill the cache in place instead of running the prompt (0: never)")
    ap.add_argument("--device-lock", default=None, metavar="DIR",
                    help="take the device from the quality runs for the timed parts (kvpop_lab.peers.device_lock)")
    ap.add_argument("--lock-whole-from", type=int, default=0, metavar="BATCH",
                    help="rows of batch >= BATCH hold the device for the whole call, compilation included (0: never)")
    return ap


def budgets(args, rows: list[tuple[int, int]]) -> dict[int, tuple[int, int, int]]:
    """``{context: (sinks, window, topk)}`` of the kvpop rows; a budget without long-range slots is an error."""
    out = {}
    for context, _ in rows:
        B = budget_entries(args.compression, context)
        if B <= args.sinks + args.window:
            raise ValueError(f"context {context} at compression {args.compression} gives B={B} <= sinks + window = "
                             f"{args.sinks + args.window}: use a longer context or a lower compression")
        out[context] = (args.sinks, args.window, B - args.sinks - args.window)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    check_steps(args.new_tokens, args.warmup)
    rows = parse_rows(args.rows)
    kvpop_budgets = budgets(args, rows) if args.system == "kvpop" else {}

    import torch

    from kvpop_lab.bench.generate_call_speed import measure
    from kvpop_lab.bench.shapes import build_model
    from kvpop_lab.peers.device_lock import DeviceLock
    from kvpop_lab.utils.provenance import versions

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, device, dtype, max(c for c, _ in rows) + args.new_tokens + 16)
    loop, projections = ("run_ahead", "fused") if args.system == "kvpop" else ("stock", "separate")
    if projections == "fused":
        from kvpop_hf.ops.fused_projections import fuse_projection_storage

        fuse_projection_storage(model)
    with torch.no_grad():  # cuBLAS and the eager kernels start up outside the first row's prefill
        model(torch.ones(1, 256, dtype=torch.long, device=device))
    lock = DeviceLock(args.device_lock)
    ns = argparse.Namespace(sinks=None, window=None, topk=None, prefill_chunk=args.prefill_chunk, new_tokens=args.new_tokens,
                            warmup=args.warmup, synthetic_from=args.synthetic_from or None, compile_mode=None,
                            no_retry=False, process="first")
    common = {"system": args.system, "path": SYSTEMS[args.system], "shape": args.shape, "dtype": str(dtype)[6:],
              "versions": versions("torch", "transformers", "triton"),
              **run_stamp("kvpop_lab.peers.speed_ours", argv, device)}
    for i, (context, batch) in enumerate(rows):
        if i:  # a fresh compile for this row's shapes, as in a process of its own (no dynamic-shape graph)
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ns.sinks, ns.window, ns.topk = kvpop_budgets.get(context, (None, None, None))
        whole = bool(args.lock_whole_from) and batch >= args.lock_whole_from
        row = measure(model, "kvpop" if args.system == "kvpop" else "static", args.scorer, context, batch, ns, device,
                      loop=loop, projections=projections, lock=lock, lock_whole=whole)
        B = ns.sinks + ns.window + ns.topk if args.system == "kvpop" else context  # StaticCache: every prompt token
        row.update(common, B=B, filled="in place" if row.get("synthetic") else "prefill")
        append_row(args.out, row)
        print(f"{args.system} ctx {context} batch {batch}: {row['decode_ms']} ms/step, prefill "
              f"{row.get('prefill_s')} s, peak {row['peak_gb']} GB, first step {row['first_step_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
