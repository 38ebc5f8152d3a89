"""Decode speed and memory of hybrid models through ``model.generate``: KVpopCache against the model's default cache.

Random bf16 weights in the shape of a released hybrid model (speed and memory do not depend on weight values):

* ``gemma3-12b``: ``Gemma3ForCausalLM``, 48 layers, five sliding-window layers (window 1024) per full-attention
  layer, 16 query / 8 KV heads of 256;
* ``gpt-oss-20b``: ``GptOssForCausalLM``, 24 layers alternating sliding (window 128) and full attention, learned
  attention sinks, 32 experts (4 active), 64 query / 8 KV heads of 64;
* ``qwen3-next-80b-12l``: ``Qwen3NextForCausalLM`` with Qwen3-Next-80B-A3B's dimensions but 12 of its 48 layers
  (9 Gated DeltaNet linear-attention layers, 3 full-attention layers, so the random bf16 weights fit one 80 GB GPU),
  512 experts (10 active), 16 query / 2 KV heads of 256;
* ``tiny-gemma3`` / ``tiny-gpt-oss`` / ``tiny-qwen3-next``: the same layer patterns at toy size, for a CPU check of the
  script.

Per (shape, cache, context), one prompt of ``context`` random token ids:

* ``default``: ``model.generate(ids, prefill_chunk_size=C, ...)`` with no cache argument: transformers builds the
  model's default cache (sliding layers hold their window, full-attention layers everything) and attends with the
  model's default attention implementation;
* ``kvpop``: ``KVpopCache(model.config, sinks, window, topk, scorer)`` (KVpop on the full-attention layers,
  transformers' fixed-size sliding layer on the others), attention ``"kvpop"``, the prompt filled by
  ``kvpop_hf.prefill_in_chunks(model, cache, ids, C)`` before ``generate`` continues.

Greedy, exactly ``--new-tokens`` tokens. A stopping criterion records the synchronised time after every token:
``prefill_s`` is the call's start to the first token, ``decode_ms`` the median gap between tokens after
``--warmup`` tokens, ``peak_gb`` the peak allocated GPU memory during the call above the weights, ``cache_gb``
what the cache holds at the end. ``--compile off`` decodes eagerly for both caches (``disable_compile=True``; the
default cache is never compiled by ``generate``); ``auto`` lets ``generate`` compile where it does (KVpopCache on
CUDA); ``force`` makes it compile on any device (``CompileConfig._compile_all_devices``, backend
``--compile-backend``: ``eager`` for a CPU check). ``graphs`` and ``graph_breaks`` count what dynamo compiled during
the ``generate`` call (``torch._dynamo.utils.counters``), and ``compiled`` says what that means: ``yes`` (the decode
step is one graph, compiled once), ``no`` (nothing compiled), or ``partly`` (several graphs or breaks: recompiles or
a step cut into pieces, where dynamo may have reached its recompile limit and run the rest eagerly). Rows are appended to ``--out`` (CSV) as they finish, each with the command, commit and date; a row that
runs out of memory says ``OOM``, one that fails otherwise ``error: <exception>`` (traceback printed), one started after ``--deadline`` seconds is skipped.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from kvpop_hf.cli.budget_flags import add_budget_flags

ROOT = Path(__file__).resolve().parents[3]
COLUMNS = ["shape", "cache", "context", "prefill_s", "decode_ms", "tokens_per_s", "peak_gb", "cache_gb", "compiled",
           "graphs", "graph_breaks", "status", "command", "commit", "date"]
SHAPES = ["gemma3-12b", "gpt-oss-20b", "qwen3-next-80b-12l", "tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next"]


def config_for(shape: str, max_pos: int):
    """The transformers config of ``shape`` (a released model's dimensions, random weights)."""
    from transformers import Gemma3TextConfig, GptOssConfig, Qwen3NextConfig

    if shape == "gemma3-12b":
        return Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                                sliding_window=1024, query_pre_attn_scalar=256, max_position_embeddings=max_pos)
    if shape == "gpt-oss-20b":
        return GptOssConfig(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                            max_position_embeddings=max_pos)
    if shape == "tiny-gemma3":
        return Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=32,
                                query_pre_attn_scalar=16, max_position_embeddings=max_pos)
    if shape == "tiny-gpt-oss":
        return GptOssConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            vocab_size=512, sliding_window=16, max_position_embeddings=max_pos)
    if shape == "qwen3-next-80b-12l":
        return Qwen3NextConfig(hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2,
                               head_dim=256, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, vocab_size=151936, linear_num_value_heads=32,
                               linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
                               max_position_embeddings=max_pos)
    if shape == "tiny-qwen3-next":
        return Qwen3NextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, intermediate_size=64, vocab_size=512,
                               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"],
                               max_position_embeddings=max_pos)
    raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")


def build_model(shape: str, device: str, dtype, max_pos: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_for(shape, max_pos), dtype=dtype)
    return model.eval()


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compiled_verdict(graphs: int, breaks: int) -> str:
    """``yes``: one graph and no break (the decode step compiled once); ``no``: nothing compiled; else ``partly``."""
    if graphs == 0 and breaks == 0:
        return "no"
    return "yes" if (graphs, breaks) == (1, 0) else "partly"


def _compile_kwargs(args) -> dict:
    if args.compile == "off":
        return dict(disable_compile=True)
    if args.compile == "auto":
        return {}
    from transformers import CompileConfig

    config = CompileConfig(backend=args.compile_backend)
    config._compile_all_devices = True  # generate compiles on CUDA only unless told so
    return dict(compile_config=config)


class Clock:
    """A stopping criterion that records the synchronised time after every generated token."""

    def __init__(self, device: str):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _cache_bytes(cache) -> int:
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def measure(model, kind: str, context: int, args, device: str) -> dict:
    """One ``generate`` call (see the module docstring); returns the row's measured fields."""
    from transformers import StoppingCriteriaList

    import kvpop_hf
    from kvpop_hf.compat import with_cache

    default_attn = model.config._attn_implementation
    ids = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    clock = Clock(device)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  stopping_criteria=StoppingCriteriaList([clock]), **_compile_kwargs(args))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    start = time.perf_counter()
    with torch.no_grad():
        if kind == "kvpop":
            model.set_attn_implementation("kvpop")
            cache = kvpop_hf.KVpopCache(model.config, sinks=args.sinks, window=args.window, topk=args.topk,
                                        scorer=args.scorer)
            kvpop_hf.prefill_in_chunks(model, cache, ids, args.prefill_chunk)
            before = _dynamo_counts()
            out = model.generate(ids, **with_cache(model, cache, **kwargs))
            model.set_attn_implementation(default_attn)
        else:
            before = _dynamo_counts()
            out = model.generate(ids, prefill_chunk_size=args.prefill_chunk, return_dict_in_generate=True, **kwargs)
            cache = out.past_key_values
    graphs, breaks = (after - start for after, start in zip(_dynamo_counts(), before))
    gaps = [1000 * (b - a) for a, b in zip(clock.times[args.warmup:], clock.times[args.warmup + 1:])]
    decode_ms = statistics.median(gaps) if gaps else float("nan")
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if device == "cuda" else 0.0
    row = dict(prefill_s=f"{clock.times[0] - start:.2f}", decode_ms=f"{decode_ms:.2f}",
               tokens_per_s=f"{1000 / decode_ms:.1f}", peak_gb=f"{peak:.2f}", cache_gb=f"{_cache_bytes(cache) / 1e9:.3f}",
               compiled=compiled_verdict(graphs, breaks), graphs=graphs, graph_breaks=breaks, status="ok")
    del out, cache
    return row


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["gemma3-12b", "gpt-oss-20b"], choices=SHAPES)
    ap.add_argument("--caches", nargs="+", default=["default", "kvpop"], choices=["default", "kvpop"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    add_budget_flags(ap, sinks=4, window=256, topk=3836)
    ap.add_argument("--scorer", default="mlstm", help="KVpop scorer (random weights: speed does not depend on them)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--compile", choices=["off", "auto", "force"], default="off")
    ap.add_argument("--compile-backend", default="inductor", help="backend of --compile force (eager: a CPU check)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which no new row starts")
    ap.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", required=True, help="CSV file; rows are appended as they finish")
    args = ap.parse_args(argv)
    if args.warmup + 2 > args.new_tokens:
        ap.error(f"--new-tokens ({args.new_tokens}) must exceed --warmup + 1 ({args.warmup + 1})")
    for shape in args.shapes:
        config_for(shape, 8)  # unknown shapes fail before any work
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    command = "python benchmarks/hybrid_generate_speed.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    commit, date = args.commit or _commit(), _dt.date.today().isoformat()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.is_file()
    if not new:
        with open(out, newline="") as fh:
            header = next(csv.reader(fh), None)
        if header != COLUMNS:
            ap.error(f"{out} has the columns {header}, not this script's {COLUMNS}: name another --out")
    t0 = time.perf_counter()
    with open(out, "a", newline="") as fh:
        writer = csv.DictWriter(fh, COLUMNS)
        if new:
            writer.writeheader()
        for shape in args.shapes:
            model = build_model(shape, args.device, dtype, max(args.contexts) + args.new_tokens + 8)
            for context in args.contexts:
                for kind in args.caches:
                    row = dict(shape=shape, cache=kind, context=context, command=command, commit=commit, date=date)
                    if time.perf_counter() - t0 > args.deadline:
                        row["status"] = "skipped (deadline)"
                    else:
                        try:
                            row.update(measure(model, kind, context, args, args.device))
                        except torch.OutOfMemoryError:
                            row["status"] = "OOM"
                        except Exception as exc:  # recorded, and the next rows still run
                            traceback.print_exc()
                            row["status"] = f"error: {type(exc).__name__}"
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                    writer.writerow(row)
                    fh.flush()
                    print(" ".join(f"{k}={row.get(k, '')}" for k in COLUMNS[:12]), flush=True)
            del model
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
