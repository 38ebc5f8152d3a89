"""kvpress's presses on the exported problems: greedy generation of the testbed teacher, token ids out. Runs in its
own environment (kvpress 0.5.5 needs transformers < 5.3) and imports nothing of kvpop_hf; score the output with
``python -m kvpop_lab.peers.score``.

    PYTHONPATH=benchmarks /work/peers/kvpress-venv/bin/python -m kvpop_lab.peers.run_kvpress \\
        --problems /work/peers/data/record_4k.jsonl --out /work/peers/out/kvpress [--n 20] \\
        [--presses dense,snapkv,knorm,streaming,tova,keydiff] [--modes prefill,decoding] [--compressions 0.88,0.94] \\
        [--device cuda] [--shard 0/4] [--device-lock DIR]

Per (press, mode, compression) one JSONL ``<press>_<mode>_cr<NN>.jsonl`` (``dense.jsonl`` for no press): per
problem ``index``, ``seed``, ``generated_ids``, ``entries_end`` (the most KV entries a layer and head holds when
generation ends) and ``seconds``. Modes (``kvpop_lab.peers.mapping``): ``prefill`` compresses the prompt to exactly ``B``
entries per head and lets decoding append; ``decoding`` adds a ``DecodingPress`` with ``target_size = B`` that
compresses back to ``B`` every ``compression_interval`` steps (kvpress's ``PrefillDecodingPress``). Batch 1,
float32, sdpa attention, max new tokens from the problem file; problems outer, presses inner, so an interrupted
run leaves every press on the same first problems. ``--device`` (default cpu) places the model and the ids;
``--shard I/N`` runs the problems ``i % N == I`` (``kvpop_lab.peers.runfiles``: one folder per shard, then
``--merge``); ``--device-lock DIR`` takes the device shared for each generation
(``kvpop_lab.peers.device_lock``: a speed measurement in another process takes it alone for its timed parts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvpop_lab.peers.device_lock import DeviceLock
from kvpop_lab.peers.mapping import decoding_interval, prefill_ratio
from kvpop_lab.peers.runfiles import (add_run_flags, check_done_in, done_in, open_run_file, parse_shard, shard_rows,
                                      write_meta)
from kvpop_lab.utils.provenance import git_commit

PRESSES = ("dense", "snapkv", "knorm", "streaming", "tova", "keydiff")
MODES = ("prefill", "decoding")


def make_press(name: str, ratio: float = 0.0):
    """A kvpress ScorerPress by our policy name, at ``ratio`` (kvpress's defaults otherwise, SnapKV's window 64
    and kernel 5 as KVpop's snapkv, StreamingLLM's 4 sinks as KVpop's)."""
    import kvpress

    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "streaming":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "keydiff":
        return kvpress.KeyDiffPress(compression_ratio=ratio)
    raise ValueError(f"unknown press {name!r}; choose from {', '.join(PRESSES)}")


def build(name: str, mode: str, prompt_len: int, budget: int):
    """The press object for one problem (None for dense)."""
    import kvpress

    if name == "dense":
        return None
    prefill = make_press(name, prefill_ratio(prompt_len, budget))
    if mode == "prefill":
        return prefill
    decoding = kvpress.DecodingPress(base_press=make_press(name), compression_interval=decoding_interval(name),
                                     target_size=budget)
    return kvpress.PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)


def generate(model, row: dict, press) -> tuple[list[int], int]:
    """Greedy ids after the prompt and the most entries a layer holds at the end (on the model's device)."""
    import contextlib

    import torch
    from transformers import DynamicCache

    ids = torch.tensor([row["prompt_ids"]], device=model.device)
    cache = DynamicCache()
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=row["max_new_tokens"],
                             do_sample=False, eos_token_id=row["eos_token_id"], pad_token_id=row["pad_token_id"],
                             past_key_values=cache)
    entries = max(layer.keys.shape[-2] for layer in cache.layers)
    return out[0, ids.shape[1]:].tolist(), entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", required=True, help="JSONL from python -m kvpop_lab.peers.export")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--model", default="checkpoints/testbed-4k-teacher")
    ap.add_argument("--n", type=int, default=0, help="first n problems (0: all)")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--compressions", default="0.88,0.94")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_run_flags(ap)
    args = ap.parse_args(argv)
    try:
        check_done_in(args.done_in)  # before any work
    except ValueError as err:
        ap.error(str(err))
    presses = [p for p in args.presses.split(",") if p]
    modes = [m for m in args.modes.split(",") if m]
    comps = [c for c in args.compressions.split(",") if c]
    bad = [p for p in presses if p not in PRESSES] + [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown press or mode {bad}; presses: {', '.join(PRESSES)}; modes: {', '.join(MODES)}")
    rows = [json.loads(line) for line in Path(args.problems).read_text().splitlines() if line.strip()]
    if args.n:
        rows = rows[:args.n]
    n_file = len(rows)
    try:
        rows = shard_rows(rows, parse_shard(args.shard))
    except ValueError as err:
        ap.error(str(err))
    if not rows:
        ap.error(f"shard {args.shard} of {args.problems} holds no problem: use fewer shards than problems")
    missing = [c for c in comps if c not in rows[0]["budgets"]]
    if missing:
        ap.error(f"compressions {missing} have no budget in {args.problems} (it has {sorted(rows[0]['budgets'])})")

    import torch
    import transformers
    import kvpress
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).eval()
    lock = DeviceLock(args.device_lock)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_meta(out, {
        "argv": sys.argv, "torch": torch.__version__, "transformers": transformers.__version__,
        "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"), "model": args.model,
        "dtype": "float32", "attn_implementation": "sdpa", "n": n_file, "shard": args.shard,
        "device": _device_name(device), "commit": git_commit(Path(__file__)),
        "date": time.strftime("%Y-%m-%d", time.gmtime())}, args.resume)
    runs = [("dense", None, None)] if "dense" in presses else []
    runs += [(p, m, c) for p in presses if p != "dense" for c in comps for m in modes]
    files, done = {}, {}
    for name, mode, comp in runs:
        tag = "dense" if name == "dense" else f"{name}_{mode}_cr{round(100 * float(comp))}"
        files[(name, mode, comp)], done[(name, mode, comp)] = open_run_file(out / f"{tag}.jsonl", args.resume)
        done[(name, mode, comp)] |= done_in(args.done_in, f"{tag}.jsonl")
    # problems outer, presses inner: an interrupted run leaves every press on the same first problems
    for row in rows:
        for name, mode, comp in runs:
            if row["index"] in done[(name, mode, comp)]:
                continue
            t = time.time()
            press = None if name == "dense" else build(name, mode, len(row["prompt_ids"]), row["budgets"][comp])
            with lock.shared():
                gen, entries = generate(model, row, press)
                if device.type == "cuda" and args.device_lock:
                    torch.cuda.empty_cache()  # the cached blocks back to the device, for the measurement beside
            fh = files[(name, mode, comp)]
            fh.write(json.dumps({"index": row["index"], "seed": row["seed"], "press": name, "mode": mode,
                                 "compression": comp, "B": None if comp is None else row["budgets"][comp],
                                 "generated_ids": gen, "entries_end": entries,
                                 "seconds": round(time.time() - t, 3)}) + "\n")
            fh.flush()
        print(f"problem {row['index']} done", flush=True)
    for fh in files.values():
        fh.close()
    return 0


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
