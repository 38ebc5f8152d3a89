"""The first and the second prompt of a fresh process: where the first prompt's extra seconds go.

    python -m kvpop_lab.bench.first_prompt --device cuda --shape qwen3-8b --contexts 32768 131072 \\
        --paths default fastest static --out results_first_prompt.csv

Each (path, context) runs in processes of its own, each timing two prompts of ``context`` random tokens
(``prompt`` 1 and 2, a fresh cache each) to their first token:

* ``default``: ``KVpopCache(model.config, knorm, B = 4 + 256 + 3836)``, ``prefill_in_chunks(model, cache, ids, C)``,
  then ``model.generate(ids, past_key_values=cache, max_new_tokens=1)``;
* ``fastest``: the same after ``fuse_projection_storage(model)``, generate with ``custom_generate=run_ahead_sample``
  and ``compile_config=fused_compile_config()``;
* ``static``: ``model.generate(ids, cache_implementation="static", max_new_tokens=1)`` (one sdpa prefill).

``process``: ``cold`` runs with empty inductor and Triton caches (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``
in a fresh folder: a new machine), ``warm`` is a second fresh process on those filled caches (a machine that served
before, or one warmed by ``kvpop-warm-compile``). ``prefill_s``: from the call's start to the first token
(synchronised); ``compile_s``: the time dynamo and inductor spent compiling inside it
(``torch._dynamo.utils.compilation_time_metrics``); ``graphs``: the graphs dynamo compiled inside it. The decode
step's compilation (``generate``'s second token) is not in these rows: one token is generated.

Rows are appended to ``--out`` (CSV) with the device, command, commit and date.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = ("default", "fastest", "static")
COLUMNS = ["path", "context", "process", "prompt", "prefill_s", "compile_s", "graphs", "peak_gb", "status", "device",
           "command", "commit", "date"]
BUDGET = {"sinks": 4, "window": 256, "topk": 3836}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-8b", help="a shape of kvpop_lab.bench.shapes.SHAPES")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--processes", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=BUDGET["topk"], help="KVpop's top-k slots (sinks 4, window 256)")
    ap.add_argument("--out", required=True, help="CSV the rows are appended to")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one process's JSON spec
    return ap


def _compile_seconds() -> float:
    import torch._dynamo.utils as dynamo_utils

    return float(sum(dynamo_utils.compilation_time_metrics.get("_compile.compile_inner", [])))


def _graphs() -> int:
    import torch._dynamo.utils as dynamo_utils

    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def child(spec: dict) -> list[dict]:
    """Two prompts of one (path, context) in this process; a row per prompt."""
    import torch

    from kvpop_hf import KVpopCache, prefill_in_chunks, run_ahead_sample
    from kvpop_hf.compat import with_cache
    from kvpop_lab.bench.shapes import build_model

    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    context, path = spec["context"], spec["path"]
    model = build_model(spec["shape"], device, dtype, context + 64)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    if path != "static":
        model.set_attn_implementation("kvpop")
    if path == "fastest":
        from kvpop_hf import fuse_projection_storage, fused_compile_config

        fuse_projection_storage(model)
        gen.update(custom_generate=run_ahead_sample, compile_config=fused_compile_config())
    rows = []
    for prompt in (1, 2):
        ids = torch.randint(1, model.config.vocab_size, (1, context), device=device,
                            generator=torch.Generator(device).manual_seed(prompt))
        weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        compile_before, graphs_before = _compile_seconds(), _graphs()
        start = time.perf_counter()
        with torch.inference_mode():
            if path == "static":
                model.generate(ids, cache_implementation="static", **gen)
            else:
                cache = KVpopCache(model.config, scorer="knorm", **{**BUDGET, "topk": spec["topk"]})
                prefill_in_chunks(model, cache, ids, spec["prefill_chunk"])
                model.generate(ids, **with_cache(model, cache, **gen))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated(device) - weights) / 1e9 if device.type == "cuda" else 0.0
        rows.append({"prompt": prompt, "prefill_s": round(seconds, 3),
                     "compile_s": round(_compile_seconds() - compile_before, 3), "graphs": _graphs() - graphs_before,
                     "peak_gb": round(peak, 2), "status": "ok"})
        del ids
        if path != "static":
            del cache
    return rows


def run_process(spec: dict, caches: Path) -> list[dict]:
    """``spec`` in a fresh Python process whose inductor and Triton caches live under ``caches``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    res = subprocess.run([sys.executable, "-m", "kvpop_lab.bench.first_prompt", "--out", os.devnull,
                          "--child", json.dumps(spec)], env=env, capture_output=True, text=True)
    sys.stderr.write(res.stderr[-4000:])
    if res.returncode != 0:
        status = "OOM" if "OutOfMemoryError" in res.stderr else f"error (exit {res.returncode})"
        return [{"prompt": p, "status": status} for p in (1, 2)]
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.prefill_chunk < 1 or min(args.contexts) < 2 or args.topk < 0:
        raise SystemExit("--prefill-chunk and --contexts must be positive (contexts >= 2) and --topk >= 0")
    import torch

    from kvpop_lab.utils.provenance import git_commit

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu")
    stamp = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "command": "python -m kvpop_lab.bench.first_prompt " + " ".join(sys.argv[1:] if argv is None else argv),
             "commit": git_commit(Path(__file__)), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not out.is_file()
    with open(out, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new_file:
            writer.writeheader()
        for path in args.paths:
            for context in args.contexts:
                spec = {"device": args.device, "shape": args.shape, "path": path, "context": context,
                        "prefill_chunk": args.prefill_chunk, "topk": args.topk}
                with tempfile.TemporaryDirectory(prefix="kvpop_first_prompt_") as caches:
                    for process in args.processes:
                        for row in run_process(spec, Path(caches)):
                            row = {**row, "path": path, "context": context, "process": process, **stamp}
                            writer.writerow({k: row.get(k, "") for k in COLUMNS})
                            fh.flush()
                            print(f"{path} {context} {process} prompt {row['prompt']}: {row.get('prefill_s')} s "
                                  f"(compile {row.get('compile_s')} s, {row.get('graphs')} graphs) {row['status']}",
                                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
