"""This repository's policies on the exported problems, through kvpop-eval's exact-match function
(``kvpop_lab.testbed.dense_eval.exact_match``) with the kvpop attention: the KVpop side of the peers table.

    python -m kvpop_lab.peers.run_ours --problems /work/peers/data/record_4k.jsonl \\
        --out /work/peers/out/kvpop [--n 20] [--policies dense,snapkv,knorm,streaming,tova,keydiff] \\
        [--device cuda] [--shard 0/4] [--device-lock DIR]

Each policy keeps ``B = round((1 - c) * 4096)`` entries per layer and KV head at every step (4 sinks, the 64 newest
tokens, ``B - 68`` slots by the policy's score), as kvpop-eval runs it. The problems are regenerated from their
seeds and checked against the file's prompt ids. One JSONL per (policy, compression), ``<policy>_cr<NN>.jsonl``
(``dense.jsonl``): ``index``, ``seed``, ``correct``, ``prediction``, ``answer``, ``generated``, ``seconds``. Batch 1
(generation length: the problem's own, as in the file). The static-score policies get the prompt in
``--prefill-chunk`` token chunks (CPU time: one 3991-token chunk costs a 3991 x 3991 visibility mask per layer);
by the eviction contract every query keeps the same set either way. Problems outer, policies inner, so an interrupted run
leaves every policy on the same first problems. Decoding is eager on every device (``disable_compile``: on CUDA
``generate`` would compile the decode step, and a compiled call refuses prompt chunks), the path of the CPU rows.
``--device`` (default cpu), ``--shard I/N`` and ``--device-lock DIR`` as in ``kvpop_lab.peers.run_kvpress``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvpop_lab.peers.device_lock import DeviceLock
from kvpop_lab.peers.runfiles import (add_run_flags, check_done_in, done_in, open_run_file, parse_shard, shard_rows,
                                      write_meta)
from kvpop_lab.peers.problems import POLICIES, RECORD, bind_factory, budget, exact_match, load_model, read_jsonl, record_problems

DEFAULT = ("dense", "snapkv", "knorm", "streaming", "tova", "keydiff")


def check_problems(problems, rows, tokenizer) -> None:
    """The regenerated problems encode to the file's prompt ids (the peers saw the same tokens)."""
    for p, row in zip(problems, rows):
        if tokenizer(p.prompt)["input_ids"] != row["prompt_ids"]:
            raise ValueError(f"problem {row['index']} (seed {row['seed']}) does not encode to the ids of the problem "
                             "file: re-export it with python -m kvpop_lab.peers.export.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", required=True, help="JSONL from python -m kvpop_lab.peers.export")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="checkpoints/testbed-4k-teacher")
    ap.add_argument("--n", type=int, default=0, help="first n problems (0: all in the file)")
    ap.add_argument("--policies", default=",".join(DEFAULT))
    ap.add_argument("--compressions", default="0.88,0.94")
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="feed the prompt in chunks of this many tokens to the static-score policies (streaming, knorm, "
                         "keydiff: the same kept sets as one chunk, docs/design.md section 1); 0: one chunk. "
                         "TOVA and SnapKV always take the prompt as one chunk, as kvpop-eval does")
    ap.add_argument("--window", type=int, default=RECORD["window"],
                    help="the protected window (the record's 64); the budget B stays, topk = B - 4 - window")
    ap.add_argument("--snapkv-obs-window", type=int, default=0,
                    help="SnapKV's voting queries (0: the window, as kvpop-eval sets it)")
    add_run_flags(ap)
    args = ap.parse_args(argv)
    try:
        check_done_in(args.done_in)  # before any work
    except ValueError as err:
        ap.error(str(err))
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES or POLICIES[p].needs_checkpoint]
    if bad:
        ap.error(f"{bad}: not a policy without checkpoint; choose from {', '.join(DEFAULT)} (kvpop-eval names)")
    comps = [float(c) for c in args.compressions.split(",") if c]
    for c in comps:
        try:
            budget(c, window=args.window)
        except ValueError as err:
            ap.error(str(err))
    rows = read_jsonl(args.problems)
    rows = rows[:args.n] if args.n else rows
    if args.prefill_chunk < 0:
        ap.error(f"--prefill-chunk must be >= 0, got {args.prefill_chunk}")
    if any(r["seed"] != RECORD["seed_base"] + r["index"] for r in rows):
        ap.error(f"{args.problems} is not the table of record's draw (seed = {RECORD['seed_base']} + index)")
    try:
        shard = parse_shard(args.shard)
    except ValueError as err:
        ap.error(str(err))
    if not shard_rows(rows, shard):
        ap.error(f"shard {args.shard} of {args.problems} holds no problem: use fewer shards than problems")

    import torch
    from transformers import AutoTokenizer

    from kvpop_hf import KVpopCache
    from kvpop_lab.utils.provenance import git_commit

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    problems = record_problems(len(rows))
    check_problems(problems, rows, tok)
    pairs = shard_rows(list(zip(rows, problems)), shard, index=lambda pair: pair[0]["index"])
    model = load_model(args.model, torch.float32, device)
    model.generation_config.disable_compile = True
    lock = DeviceLock(args.device_lock)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_meta(out, {"argv": sys.argv, "n": len(rows), "shard": args.shard, "batch_size": 1,
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "prefill_chunk_static": args.prefill_chunk, "dtype": "float32", "torch": torch.__version__,
                     "commit": git_commit(Path(__file__)), "date": time.strftime("%Y-%m-%d", time.gmtime())},
               args.resume)
    runs = [("dense", None)] if "dense" in policies else []
    runs += [(p, c) for p in policies if p != "dense" for c in comps]
    variant = "" if args.window == RECORD["window"] else f"_w{args.window}"
    variant += f"_obs{args.snapkv_obs_window}" if args.snapkv_obs_window else ""
    files, done = {}, {}
    for name, comp in runs:
        tag = "dense" if comp is None else f"{name}_cr{round(100 * comp)}" + variant
        files[(name, comp)], done[(name, comp)] = open_run_file(out / f"{tag}.jsonl", args.resume)
        done[(name, comp)] |= done_in(args.done_in, f"{tag}.jsonl")
    # problems outer, policies inner: an interrupted run leaves every policy on the same first problems
    for row, problem in pairs:
        for name, comp in runs:
            if row["index"] in done[(name, comp)]:
                continue
            factory = None
            if comp is not None:
                b = budget(comp, window=args.window)
                make = bind_factory(name)
                factory = (lambda make=make, b=b: make(model.config, b["sinks"], b["window"], b["topk"]))
                if name == "snapkv" and args.snapkv_obs_window:
                    factory = (lambda b=b: KVpopCache(model.config, sinks=b["sinks"], window=b["window"],
                                                      topk=b["topk"], scorer="snapkv",
                                                      scorer_kwargs={"obs_window": args.snapkv_obs_window}))
            t0 = time.time()
            with lock.shared():
                em = exact_match(model, tok, [problem], batch_size=1, cache_factory=factory, progress=False,
                             prefill_chunk=args.prefill_chunk)
                if device.type == "cuda" and args.device_lock:
                    torch.cuda.empty_cache()  # the cached blocks back to the device, for the measurement beside
            o = em["outputs"][0]
            fh = files[(name, comp)]
            fh.write(json.dumps({"index": row["index"], "seed": row["seed"], "policy": name,
                                 "compression": None if comp is None else f"{comp:.2f}",
                                 "B": None if comp is None else budget(comp)["B"], "window": args.window,
                                 "obs_window": (args.snapkv_obs_window or None) if name == "snapkv" else None,
                                 "correct": o["correct"],
                                 "prediction": o["prediction"], "answer": o["answer"], "generated": o["generated"],
                                 "seconds": round(time.time() - t0, 3)}) + "\n")
            fh.flush()
        print(f"problem {row['index']} done", flush=True)
    for fh in files.values():
        fh.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
