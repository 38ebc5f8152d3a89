"""Long-context generation speed and memory: dense caches vs KVpopCache, eager and compiled decoding.

    # one H200, Qwen3-8B shapes with random bf16 weights (speed does not depend on weight values)
    python benchmarks/generation_speed.py --device cuda --shape qwen3-8b \
        --contexts 4096 16384 32768 65536 131072 --out-prefix results/generation_speed/h200
    # CPU smoke run (tiny shape)
    python benchmarks/generation_speed.py --shape tiny --contexts 256 512 --steps 4 --warmup 2 --batches

Rows, per context (prompts prefilled in ``--prefill-chunk`` token chunks, then ``--warmup`` untimed and
``--steps`` timed greedy decode steps, each step synchronised and timed alone):

* ``dynamic/eager``: DynamicCache, ``attn_implementation="sdpa"``, plain forward calls;
* ``static/compiled``: StaticCache, decode through ``model.get_compiled_call(CompileConfig())`` -- the
  call ``generate`` makes for a compileable cache (inductor, ``mode="reduce-overhead"``: CUDA graphs);
* ``kvpop-<scorer>/eager`` and ``kvpop-<scorer>/compiled``: one KVpopCache per scorer, prefilled once
  with ``attn_implementation="kvpop"``; both decode modes start from the same post-prefill state
  (buffers restored in place), are fed the same tokens, and their max |logit difference| is printed;
* ``dms/eager`` (``--rows dms``): a DMSCache (kvpop_hf/baselines/dms, ragged memory per head, not compileable) with
  ``--dms-checkpoint``'s gate, or by default a synthetic gate of the same *average* budget: a share
  ``k / (context - s - w)`` of the (layer, KV head)s keeps every token, the others keep sinks + window
  (the extremes of the KVpop paper's Figure 8); ``kept_per_head`` is the mean number of entries held. Its
  prompt chunks use a dense ``[b, h, chunk, stored + chunk]`` mask: keep ``--prefill-chunk`` moderate.

Per row: prefill seconds, peak memory above the weights during prefill and decode, resident cache
memory, decode ms/token (median, p90), and the ratio to the bandwidth floor (weights + the cache's
buffers read once per step at the copy bandwidth measured at start). ``eviction share`` is the part of
an eager step spent inside the cache's ``update`` (torch.profiler, CUDA time), and for compiled rows
``1 - (StaticCache+compile at B tokens) / (KVpop compiled)`` at the smallest context (same attention
length, so the difference is the eviction and scorer work). ``--batches`` adds batch 1/8/32 at
``--batch-context`` tokens with caches filled synthetically in place (random keys/values, a valid slot
layout; no prefill): tokens/s and peak memory, OOM where the dense cache does not fit. ``--leak-caches N``
creates, fills and drops N KVpopCaches and prints the allocated memory before and after.

benchmarks/generate_call_speed.py measures instead the user's own call, ``model.generate`` with a prefilled
KVpopCache or ``cache_implementation="static"`` (first-step compile time, decode ms, batch rows with left padding,
and a second process reusing the first one's compile cache).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import os
import shlex
import statistics
import sys
import textwrap
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig, DynamicCache, StaticCache

from kvpop_hf import KVpopCache
from kvpop_hf.cache import kv_tensor_bytes
from kvpop_hf.compat import with_cache
from kvpop_hf.baselines.dms import DMSCache, DMSGate
from kvpop_hf.backends import Backends
from kvpop_hf.cli.budget_flags import add_budget_flags
from kvpop_lab.bench.shapes import SHAPES, build_model  # noqa: F401  (build_model: used here and by other benchmarks)
from kvpop_lab.utils.provenance import git_commit
from kvpop_lab.utils.timing import quantiles, sync

REPO = Path(__file__).resolve().parents[3]
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated.*", category=FutureWarning)


# ----------------------------------------------------------------------------------------- setup
def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.float32, device=device)  # 4 GiB
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (1 << 32) / statistics.median(times[1:])


def allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak(device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def cache_bytes(cache) -> int:
    return cache.memory_bytes() if isinstance(cache, (KVpopCache, DMSCache)) else kv_tensor_bytes(cache)


def synthetic_dms_gate(config, sinks: int, window: int, topk: int, ctx: int) -> DMSGate:
    """A gate whose mean memory after ``ctx`` tokens is about ``B = s + w + k`` per head: a share
    ``k / (ctx - s - w)`` of the (layer, KV head)s, spread evenly over the layers, never evicts (bias -30), the
    others evict every token (bias +30), so they hold sinks + window only."""
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    gate = DMSGate(layers, heads, config.head_dim)
    n = layers * heads
    dense = round(n * min(1.0, topk / max(1, ctx - sinks - window)))
    with torch.no_grad():
        gate.bias.fill_(30.0)
        for i in range(dense):
            j = (i * n) // dense if dense else 0  # evenly spread in (layer, head) order
            gate.bias.view(-1)[j] = -30.0
    return gate


# ----------------------------------------------------------------------------------------- phases
def prefill(model, cache, prompt, chunk, device) -> tuple[float, torch.Tensor]:
    sync(device)
    t0 = time.perf_counter()
    logits = None
    for start in range(0, prompt.shape[1], chunk):
        logits = model(input_ids=prompt[:, start:start + chunk],
                       **with_cache(model, cache, use_cache=True, logits_to_keep=1)).logits
    sync(device)
    return time.perf_counter() - t0, logits[:, -1].argmax(-1, keepdim=True)


def decode(step, model, cache, tok, n, device, feed=None):
    """``n`` greedy steps (or the tokens ``feed [b, n]``); returns (ms per step, fed tokens, logits)."""
    times, toks, logits = [], [], []
    for i in range(n):
        cur = tok if feed is None else feed[:, i:i + 1].clone(memory_format=torch.contiguous_format)
        sync(device)
        t0 = time.perf_counter()
        out = step(input_ids=cur, **with_cache(model, cache, use_cache=True, logits_to_keep=1)).logits[:, -1]
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        toks.append(cur)
        logits.append(out.float().clone())
        tok = out.argmax(-1, keepdim=True)
    return times, torch.cat(toks, 1), torch.stack(logits, 1)


def state_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a cache layer updates in place (KVpop layer or StaticCache layer)."""
    if hasattr(layer, "_buffers") and callable(layer._buffers):
        return layer._buffers()
    return [layer.keys, layer.values, layer.cumulative_length]


def snapshot(cache):
    return [[t.clone() for t in state_tensors(layer)] for layer in cache.layers]


def restore(cache, snap) -> None:
    for layer, saved in zip(cache.layers, snap):
        for t, s in zip(state_tensors(layer), saved):
            t.copy_(s)


def eviction_share(model, cache, tok, device) -> float:
    """Share of an eager decode step's CUDA time spent inside the KVpop layers' ``update``."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile, record_function

    originals = []
    for layer in cache.layers:
        original = layer.update

        def wrapped(*a, _original=original, **k):
            with record_function("kvpop_update"):
                return _original(*a, **k)

        originals.append(original)
        layer.update = wrapped
    try:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model(input_ids=tok, **with_cache(model, cache, use_cache=True, logits_to_keep=1))
            sync(device)
    finally:
        for layer, original in zip(cache.layers, originals):
            layer.update = original
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    inside = max((e.device_time_total for e in events if e.key == "kvpop_update"), default=0.0)
    return inside / total if total else float("nan")


def prefill_stages():
    """The stages of a KVpop prompt chunk that ``--profile-prefill`` marks as profiler ranges: ``(owner, name)``
    of public methods and functions of the library, looked up where the chunk path calls them (a class's method,
    or a module function that its caller reads from the module at each call). A stage that the library no
    longer has raises here, naming it, rather than profiling without it."""
    import kvpop_hf.ops.chunk_attention as chunk_attention
    import kvpop_hf.ops.flex_mask as flex_mask
    import kvpop_hf.ops.interval_mask as interval_mask
    from kvpop_hf.layer import ChunkPlan, KVpopLayer, PendingChunk

    stages = [(KVpopLayer, "begin_chunk"), (PendingChunk, "attend"), (KVpopLayer, "commit_chunk"),
              (KVpopLayer, "keep_selection"), (ChunkPlan, "compact"), (flex_mask, "compact_chunk_mask"),
              (chunk_attention, "flex_chunk_attention"), (interval_mask, "interval_chunk_mask"),
              (interval_mask, "interval_layout"), (interval_mask, "interval_block_mask"),
              (flex_mask, "build_block_mask")]
    missing = [f"{getattr(owner, '__module__', '')}.{owner.__name__}.{name}" if isinstance(owner, type)
               else f"{owner.__name__}.{name}" for owner, name in stages if not callable(getattr(owner, name, None))]
    if missing:
        raise AttributeError(f"--profile-prefill marks {', '.join(missing)}, which the library no longer has; "
                             "update kvpop_lab.bench.generation_speed.prefill_stages")
    return stages


def profile_prefill_chunk(model, cache, prompt, chunk, device, path: Path) -> None:
    """torch.profiler table of one prefill chunk (the second), with the chunk path's stages (:func:`prefill_stages`,
    and the scorer's ``score`` / ``absorb_and_read``) as ``kvpop::<name>`` ranges; stages the chunk did not pass
    through (FlexAttention's on the dense path) are listed as not run above the table."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def ranged(fn, name):
        def wrapped(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return wrapped

    stages = prefill_stages()
    scorer_type = type(cache.scorer)
    stages += [(scorer_type, name) for name in ("score", "absorb_and_read") if callable(getattr(scorer_type, name, None))]
    saved = [(owner, name, owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name))
             for owner, name in stages]
    for owner, name in stages:
        setattr(owner, name, ranged(getattr(owner, name), f"kvpop::{name}"))
    try:
        prefill(model, cache, prompt[:, :2 * chunk], chunk, device)  # warm: compiles happen here
        cache.reset()
        prefill(model, cache, prompt[:, :chunk], chunk, device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            prefill(model, cache, prompt[:, chunk:2 * chunk], chunk, device)
    finally:
        for owner, name, fn in saved:
            if fn is None:  # inherited: drop the wrapper, the base class's method shows through again
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
    events = prof.key_averages()
    ran = {e.key: e.count for e in events if e.key.startswith("kvpop::")}
    names = list(dict.fromkeys(f"kvpop::{name}" for _, name in stages))
    lines = [f"# one prefill chunk of {chunk} tokens after {chunk} (cache {type(cache).__name__}, device {device})",
             "# stages: " + ", ".join(f"{n} x{ran[n]}" for n in names if n in ran),
             "# not run: " + (", ".join(n for n in names if n not in ran) or "none"), ""]
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    path.write_text("\n".join(lines) + events.table(sort_by=sort, row_limit=40))


def cudagraph_counters() -> dict[str, int]:
    """Inductor's CUDA-graph counters (``cudagraph_partitions``: graphs split around ops a CUDA graph cannot
    hold; ``cudagraph_skips``: graphs run without one)."""
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def host_launch_summary(events) -> str:
    """Counts of CUDA-graph replays, kernel launches outside a graph and memory copies in a profiler's events."""
    count = {e.key: e.count for e in events}
    launches = sum(n for k, n in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC"))
    copies = sum(n for k, n in count.items() if k.startswith("cudaMemcpy"))
    return (f"cudaGraphLaunch {count.get('cudaGraphLaunch', 0)}, kernel launches {launches}, memcpy {copies}, "
            f"aten ops {sum(n for k, n in count.items() if k.startswith('aten::'))}")


def check_eviction_kernel(device, dtype, trials: int = 20) -> str:
    """The fused decode eviction (Triton) against its torch reference on random states on ``device``."""
    from kvpop_hf.ops.decode_eviction import evict_and_insert_reference, evict_and_insert_triton

    if device.type != "cuda":
        return "eviction kernel check: skipped (CPU)"
    g = torch.Generator(device=device).manual_seed(0)
    bad = 0
    for trial in range(trials):
        b, h, d, (s, w, k) = 2, 8, 128, [(4, 256, 3836), (4, 16, 44), (0, 8, 0), (2, 4, 7)][trial % 4]
        B = s + w + k
        seen = torch.randint(0, 3 * B, (b,), device=device, generator=g)
        keys = torch.randn(b, h, B, d, device=device, dtype=dtype, generator=g)
        values = torch.randn(b, h, B, d, device=device, dtype=dtype, generator=g)
        slot = torch.arange(B, device=device)
        pos = torch.where(slot < seen.clamp(max=B)[:, None], slot * 3, -1)[:, None].expand(b, h, B).contiguous()
        prio = torch.where(pos >= 0, torch.randn(b, h, B, device=device, generator=g).round(), float("-inf"))
        k_new = torch.randn(b, h, d, device=device, dtype=dtype, generator=g)
        v_new = torch.randn(b, h, d, device=device, dtype=dtype, generator=g)
        p_leave = torch.randn(b, h, device=device, generator=g).round()
        p_new = torch.full((b, h), float("-inf"), device=device)
        ref = [x.clone() for x in (keys, values, pos, prio)]
        got = [x.clone() for x in (keys, values, pos, prio)]
        evict_and_insert_reference(*ref, seen, k_new, v_new, p_leave, p_new, s, w, k)
        evict_and_insert_triton(*got, seen, k_new, v_new, p_leave, p_new, s, w, k)
        bad += not all(torch.equal(a, e) for a, e in zip(got, ref))
    return f"eviction kernel check on {device}: {trials - bad}/{trials} random states equal to the torch reference"


def check_mlstm_step_kernel(device, dtype, config, budget, trials: int = 8) -> str:
    """The fused mLSTM decode step (Triton) against its torch reference on random states on ``device``."""
    from kvpop_hf.scorers.mlstm import MLSTMScorer
    from kvpop_hf.ops.mlstm_decode import mlstm_decode_priority_reference, mlstm_decode_priority_triton

    if device.type != "cuda":
        return "mLSTM step kernel check: skipped (CPU)"
    s, w, k = budget
    B = s + w + k
    b, h, d = 2, config.num_key_value_heads, config.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for trial in range(trials):
        scorer = MLSTMScorer(2, h, d, delayed=trial % 2 == 0, seed=trial).to(device)
        keys = torch.randn(b, h, B, d, device=device, dtype=dtype, generator=g)
        values = torch.randn(b, h, B, d, device=device, dtype=dtype, generator=g)
        pos = torch.randint(-1, 4 * B, (b, h, B), device=device, generator=g)
        seen = torch.randint(0, 4 * B, (b,), device=device, generator=g)
        k_new = torch.randn(b, h, 1, d, device=device, dtype=dtype, generator=g)
        v_new = torch.randn(b, h, 1, d, device=device, dtype=dtype, generator=g)
        state = scorer.init_state(0, b, device)
        gamma = -torch.rand(h, device=device, generator=g) if trial % 4 < 2 else None
        args = (keys, values, pos, seen, k_new, v_new, s, w, gamma, 64, not scorer.delayed)
        with torch.no_grad():
            ref_state = tuple(x.clone() for x in state)
            p_ref = mlstm_decode_priority_reference(scorer, trial % 2, ref_state, *args)
            p = mlstm_decode_priority_triton(scorer, trial % 2, state, *args)
        worst = max(worst, (p - p_ref).abs().max().item(), *((a - e).abs().max().item()
                                                              for a, e in zip(state, ref_state)))
    verdict = "agreed" if worst < 1e-3 else "disagreed"
    return (f"mLSTM step kernel check on {device}: max |diff| {worst:.3g} to the torch reference over {trials} random "
            f"states ({verdict})")


def check_decode_attention(device, dtype, config, B, trials: int = 8) -> str:
    """The split-KV decode attention (Triton) against its SDPA reference on random inputs of the model's
    head shapes, and the time of one layer's call of each (median of 200 calls, batch 1, ``B`` slots)."""
    from kvpop_hf.ops.decode_attention import decode_attention_reference, decode_attention_triton

    if device.type != "cuda":
        return "decode attention check: skipped (CPU)"
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    g = torch.Generator(device=device).manual_seed(1)
    worst = 0.0
    for trial in range(trials):
        b = (1, 3, 8, 32)[trial % 4]
        q = torch.randn(b, hq, 1, d, device=device, dtype=dtype, generator=g)
        k = 3 * torch.randn(b, hkv, B, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(b, hkv, B, d, device=device, dtype=dtype, generator=g)
        seen = torch.randint(1, 2 * B, (b,), device=device, generator=g)
        ref = decode_attention_reference(q, k, v, seen, None).float()
        worst = max(worst, (decode_attention_triton(q, k, v, seen, None).float() - ref).abs().max().item())
    q = torch.randn(1, hq, 1, d, device=device, dtype=dtype)
    k, v = torch.randn(1, hkv, B, d, device=device, dtype=dtype), torch.randn(1, hkv, B, d, device=device, dtype=dtype)
    seen = torch.full((1,), B, device=device)
    us = {}
    for name, fn in (("sdpa reference", decode_attention_reference), ("split kernel", decode_attention_triton)):
        for _ in range(20):
            fn(q, k, v, seen, None)
        times = []
        for _ in range(200):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(q, k, v, seen, None)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        us[name] = statistics.median(times)
    ok = worst < 0.02
    return (f"decode attention check on {device}: split kernel vs SDPA reference max |diff| {worst:.3g} over {trials} "
            f"random inputs ({'agreed' if ok else 'disagreed: this run decodes with the reference'}); one layer, "
            f"batch 1, {B} slots, eager call incl. launches: " + ", ".join(f"{n} {t:.1f} us" for n, t in us.items()))


def run_backends(args, device, eviction_note: str, attention_note: str, mlstm_note: str, notes: list) -> Backends:
    """The backends of every KVpop cache of the run: ``--mlstm-step``, and the torch reference of a kernel that
    disagreed with it in the checks above (a note says so); the other fields as the library chooses."""
    chosen = {"mlstm_step": args.mlstm_step} if args.mlstm_step else {}
    if "disagreed" in mlstm_note:
        chosen["mlstm_step"] = "torch"
        notes.append("the mLSTM step kernel disagreed: this run decodes with the torch scorer (mlstm_step=torch)")
    if "20/20" not in eviction_note and device.type == "cuda":
        chosen["decode_eviction"] = "torch"
        notes.append("the eviction kernel disagreed: this run decodes with the torch reference (decode_eviction=torch)")
    if "disagreed" in attention_note:
        chosen["decode_attention"] = "torch"
    backends = Backends(**chosen)
    step = backends.resolve(device, ("mlstm_step",)).mlstm_step
    notes.append("mLSTM decode step: " + ("the fused kernel" if step == "triton" else "the torch path"))
    return backends


# ----------------------------------------------------------------------------------------- synthetic fill
def fill_kvpop(cache: KVpopCache, model, mask: torch.Tensor) -> None:
    """A warm KVpopCache without prefill: the state ``prefill_in_chunks(model, cache, ids, n, mask)`` leaves, with
    random contents. Row ``r`` has seen ``mask[r].sum() - 1`` real tokens (its sinks, its newest ``window`` in their
    ring slots and ``topk`` distinct older tokens in the long-range slots), the cache ``mask.shape[1] - 1`` tokens
    with padding. One eager decode step allocates the buffers, which are then overwritten in place."""
    batch, context = mask.shape
    device = mask.device
    model(input_ids=torch.ones(batch, 1, dtype=torch.long, device=device), **with_cache(model, cache, use_cache=True))
    cfg = cache.kvpop_config
    s, w, k, B = cfg.sinks, cfg.window, cfg.topk, cfg.budget
    slots = torch.arange(B, device=device)
    seen = mask.sum(1) - 1
    pos = torch.empty(batch, B, dtype=torch.long, device=device)
    for r, n in enumerate(seen.tolist()):
        if n - w - s < k:
            raise ValueError(f"row {r} holds {n} tokens, too few to fill {B} slots: use a longer context")
        pos[r] = torch.where(slots < s, slots, n - w + (slots - s - (n - w - s)) % w)  # ring slot of t: s + (t-s) % w
        pos[r, s + w:] = s + torch.randperm(n - w - s, device=device)[:k].sort().values
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
        layer.pos.copy_(pos[:, None, :].expand_as(layer.pos))
        layer.prio.normal_()
        layer.seen.copy_(seen)
        layer.tokens.fill_(context - 1)
        for t in layer.state or ():
            t.normal_(std=0.01)


def fill_dense(kind, model, batch, ctx, extra, device, dtype):
    cfg = model.config
    shape = (batch, cfg.num_key_value_heads, ctx, cfg.head_dim)
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype), i)
        return cache
    cache = StaticCache(config=cfg, max_cache_len=ctx + extra)
    model(input_ids=torch.ones(batch, 1, dtype=torch.long, device=device), **with_cache(model, cache, use_cache=True))
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
        layer.cumulative_length.fill_(ctx)
    return cache


# ----------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    from_cli = argv is None  # the recorded command: the shell's, or the main() call's
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8)
    add_budget_flags(ap, sinks=4, window=256, topk=3836)
    ap.add_argument("--scorers", nargs="+", default=["knorm", "mlp", "mlstm"])
    ap.add_argument("--rows", nargs="+", default=["dynamic", "static", "kvpop"],
                    help="which cache families to run per context")
    ap.add_argument("--dms-checkpoint", default=None,
                    help="DMS gate for the dms rows (a training/train_dms.py output for this shape); default: synthetic")
    ap.add_argument("--static-contexts", type=int, nargs="*", default=None,
                    help="contexts for StaticCache+compile (default: the smallest and largest)")
    ap.add_argument("--static-synthetic", type=int, nargs="*", default=[],
                    help="contexts at which the StaticCache is filled synthetically (no prefill; decode rows only)")
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="batch sizes for the throughput rows")
    ap.add_argument("--batch-context", type=int, default=32768)
    ap.add_argument("--batch-scorers", nargs="*", default=None,
                    help="KVpop scorers of the throughput rows (default: --scorers); each batch size compiles anew")
    ap.add_argument("--leak-caches", type=int, default=0)
    ap.add_argument("--paired-repeats", type=int, default=0,
                    help="after all contexts, time the compiled decode of every KVpop cache again, alternating "
                         "between the contexts this many times (rows 'compiled-paired': the ratio between contexts "
                         "measured side by side, free of drift between the context rows)")
    ap.add_argument("--profile-prefill", action="store_true", help="write a profiler table of one KVpop chunk")
    ap.add_argument("--prefill-repeats", type=int, default=1, help="timed prefills per row (median; fresh caches)")
    ap.add_argument("--prefill-only", action="store_true",
                    help="measure prefill (seconds, peak memory) and skip the decode rows")
    ap.add_argument("--profile-decode", action="store_true",
                    help="write kernel and host-side tables of three compiled decode steps per cache (smallest "
                         "context) and print their CUDA-graph replays and launches outside a graph")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled rows")
    ap.add_argument("--mlstm-step", choices=["torch", "triton"], default=None,
                    help="the mLSTM scorer's decode step: its torch path or the fused kernel (Backends.mlstm_step of "
                         "every KVpop cache of the run; default: the library's choice, the fused kernel on CUDA)")
    ap.add_argument("--from-csv", default=None,
                    help="redraw the table and plot of an earlier run's CSV (its command and commit are kept)")
    ap.add_argument("--out-prefix", default=None)
    args = ap.parse_args(argv)
    if args.from_csv:
        return redraw(Path(args.from_csv), Path(args.out_prefix or Path(args.from_csv).with_suffix("")), args)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    prefix = Path(args.out_prefix or REPO / "results" / "generation_speed" / device.type)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) \
        if from_cli else f"main({argv!r})"
    commit = git_commit(REPO)
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    torch._dynamo.config.recompile_limit = 64  # one graph per cache kind; never fall back to eager silently
    torch._dynamo.config.accumulated_recompile_limit = 512
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "cudagraph_unexpected_rerecord_limit"):
        inductor_config.triton.cudagraph_unexpected_rerecord_limit = 1024  # a graph is re-recorded per cache

    max_ctx = max(args.contexts + [args.batch_context if args.batches else 0])
    model = build_model(args.shape, device, dtype, max_ctx + args.steps + args.warmup + 64)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device)
    s, w, k = args.sinks, args.window, args.topk
    B = s + w + k
    compiled_call = model.get_compiled_call(CompileConfig(backend=args.compile_backend))
    notes = []
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    head = (f"{args.shape} random {str(dtype)[6:]} ({weight_bytes / 1e9:.2f} GB) on {gpu}; B = {s}+{w}+{k} = {B}; "
            f"copy bandwidth {bw / 1e12:.2f} TB/s; commit {commit[:12]}; torch {torch.__version__}, "
            f"transformers {transformers.__version__}")
    print(head, flush=True)
    eviction_note = check_eviction_kernel(device, dtype)
    attention_note = check_decode_attention(device, dtype, model.config, B)
    mlstm_note = check_mlstm_step_kernel(device, dtype, model.config, (s, w, k))
    notes += [eviction_note, attention_note, mlstm_note]
    print(f"  {eviction_note}\n  {attention_note}\n  {mlstm_note}", flush=True)
    backends = run_backends(args, device, eviction_note, attention_note, mlstm_note, notes)
    static_ctx = set(args.static_contexts if args.static_contexts is not None
                     else [min(args.contexts), max(args.contexts)])

    rows = []
    gen = torch.Generator().manual_seed(0)
    profile_ctx = min((c for c in args.contexts if c >= 2 * args.prefill_chunk), default=None)
    vocab = model.config.vocab_size

    def record(ctx, batch, cache_name, mode, times, prefill_s, peak_b, resident_b, read_b, **extra):
        q = quantiles(sorted(times))
        floor_ms = (weight_bytes + read_b) / bw * 1e3 if bw == bw else float("nan")
        row = dict(context=ctx, batch=batch, cache=cache_name, mode=mode, prefill_s=prefill_s,
                   decode_ms_median=q["median"], decode_ms_p90=q["p90"], tokens_per_s=batch * 1e3 / q["median"],
                   floor_ms=floor_ms, x_floor=q["median"] / floor_ms, peak_gb=peak_b / 1e9,
                   resident_gb=resident_b / 1e9, cache_mb=read_b / 1e6, **extra)
        rows.append(row)
        write_outputs(prefix, rows, notes, head, command, commit, started, args, plot_too=False)
        print(f"  ctx {ctx:>6} b {batch:>2} {cache_name:<13} {mode:<8} prefill {prefill_s:7.2f} s  decode "
              f"{q['median']:7.2f} ms (p90 {q['p90']:.2f})  {row['x_floor']:.2f}x floor  peak {row['peak_gb']:.2f} GB  "
              f"resident {row['resident_gb']:.3f} GB " + " ".join(f"{a}={b}" for a, b in extra.items()), flush=True)

    def eager_and_compiled(ctx, name, cache, tok, pre_s, base, read_b):
        """Eager, then compiled decoding from the same post-prefill state; the compiled steps' logits are
        compared with eager ones on the same tokens."""
        peak_pre, resident = peak(device) - base, allocated(device) - base
        snap = snapshot(cache)
        reset_peak(device)
        decode(model, model, cache, tok, args.warmup, device)
        times_e, fed, _ = decode(model, model, cache, tok, args.steps, device)
        share = eviction_share(model, cache, fed[:, -1:], device) if name.startswith("kvpop") else None
        record(ctx, 1, name, "eager", times_e, pre_s, max(peak_pre, peak(device) - base), resident, read_b,
               **({} if share is None else {"eviction_share": round(share, 3)}))
        restore(cache, snap)
        reset_peak(device)
        t0 = time.perf_counter()
        graphs_before = cudagraph_counters()
        _, warm_fed, _ = decode(compiled_call, model, cache, tok, args.warmup, device)
        compile_s = time.perf_counter() - t0
        graphs = {k: v - graphs_before.get(k, 0) for k, v in cudagraph_counters().items()}
        times_c, _, logits_c = decode(compiled_call, model, cache, tok, args.steps, device, feed=fed)
        restore(cache, snap)
        _, _, logits_e = decode(model, model, cache, tok, args.warmup + args.steps, device,
                                feed=torch.cat([warm_fed, fed], 1))
        logits_e = logits_e[:, args.warmup:]
        dlogit = (logits_c - logits_e).abs().max().item()
        same_top = (logits_c.argmax(-1) == logits_e.argmax(-1)).float().mean().item()
        if args.profile_decode and ctx == min(args.contexts) and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                decode(compiled_call, model, cache, tok, 3, device)
            events = prof.key_averages()
            Path(f"{prefix}_decode_profile_{name}_{ctx}.txt").write_text(
                events.table(sort_by="cuda_time_total", row_limit=30))
            # host side of the same three steps: graph replays, kernels launched outside a graph, eager ops
            Path(f"{prefix}_decode_profile_{name}_{ctx}_host.txt").write_text(
                events.table(sort_by="self_cpu_time_total", row_limit=40))
            print(f"  {name} host side of 3 compiled steps: {host_launch_summary(events)}")
        record(ctx, 1, name, "compiled", times_c, pre_s, max(peak_pre, peak(device) - base), resident, read_b,
               max_abs_dlogit=f"{dlogit:.3g}", logit_scale=f"{logits_e.abs().max().item():.3g}",
               same_argmax=f"{same_top:.3f}", warmup_s=round(compile_s, 1),
               **{k: v for k, v in graphs.items() if v})
        return snap

    paired: dict[str, dict[int, tuple]] = {}  # cache name -> context -> (cache, post-prefill snapshot, token, bytes)

    def paired_decode() -> None:
        """Compiled decode of each kept KVpop cache, the contexts alternating ``--paired-repeats`` times; each
        visit restores the post-prefill state and runs ``--warmup`` untimed steps first (the CUDA graph is
        re-recorded for the other cache's buffers)."""
        for name, per_ctx in paired.items():
            times = {ctx: [] for ctx in per_ctx}
            for _ in range(args.paired_repeats):
                for ctx, (cache, snap, tok, _) in per_ctx.items():
                    restore(cache, snap)
                    decode(compiled_call, model, cache, tok, args.warmup, device)
                    times[ctx] += decode(compiled_call, model, cache, tok, args.steps, device)[0]
            medians = {}
            for ctx, (_, _, _, read_b) in per_ctx.items():
                record(ctx, 1, name, "compiled-paired", times[ctx], float("nan"), float("nan"), float("nan"), read_b,
                       repeats=args.paired_repeats)
                medians[ctx] = statistics.median(times[ctx])
            lo, hi = min(medians), max(medians)
            if hi != lo:
                notes.append(f"paired decode, {name}: {medians[hi]:.2f} ms at {hi} vs {medians[lo]:.2f} ms at {lo} "
                             f"(ratio {medians[hi] / medians[lo]:.3f}; medians of {args.paired_repeats} x "
                             f"{args.steps} compiled steps per context, the contexts alternating)")
                print("  " + notes[-1], flush=True)

    warmed: set[str] = set()

    def timed_prefill(name, cache, prompt):
        """Prefill seconds (median of ``--prefill-repeats``, the last one into ``cache``) after one untimed warm-up
        of this cache kind (two chunks: torch.compile of the FlexAttention, and its recompile for a second, dynamic
        shape, happen there, not in the timed runs). Peak memory is that of the last run."""
        if name not in warmed:
            warm = make_cache(name)
            prefill(model, warm, prompt[:, :2 * args.prefill_chunk], args.prefill_chunk, device)
            del warm
            warmed.add(name)
        runs = []
        for i in range(args.prefill_repeats):
            target = cache if i == args.prefill_repeats - 1 else make_cache(name)
            reset_peak(device)
            runs.append(prefill(model, target, prompt, args.prefill_chunk, device))
            del target
        return statistics.median(t for t, _ in runs), runs[-1][1]

    def make_cache(name):
        """A new cache of a row's kind: ``dynamic`` or ``kvpop-<scorer>`` at the benchmark's budget."""
        if name == "dynamic":
            return DynamicCache(config=model.config)
        return KVpopCache(model.config, sinks=s, window=w, topk=k, scorer=name[6:], backends=backends)

    def prefill_row(ctx, name, cache, pre_s, base, read_b):
        record(ctx, 1, name, "prefill", [float("nan")], pre_s, peak(device) - base, allocated(device) - base, read_b)

    with torch.inference_mode():
        for ctx in args.contexts:
            prompt = torch.randint(1, vocab, (1, ctx), generator=gen).to(device)
            base = allocated(device)
            if "dynamic" in args.rows:
                model.set_attn_implementation("sdpa")
                cache = make_cache("dynamic")
                pre_s, tok = timed_prefill("dynamic", cache, prompt)
                if args.prefill_only:
                    prefill_row(ctx, "dynamic", cache, pre_s, base, kv_tensor_bytes(cache))
                else:
                    decode(model, model, cache, tok, args.warmup, device)
                    times, _, _ = decode(model, model, cache, tok, args.steps, device)
                    record(ctx, 1, "dynamic", "eager", times, pre_s, peak(device) - base, allocated(device) - base,
                           kv_tensor_bytes(cache))
                del cache
                gc.collect()
            if "static" in args.rows and ctx in static_ctx and not args.prefill_only:
                model.set_attn_implementation("sdpa")
                reset_peak(device)
                if ctx in args.static_synthetic:  # decode speed only: contents do not change it
                    cache = fill_dense("static", model, 1, ctx, 2 * (args.steps + args.warmup) + 8, device, dtype)
                    pre_s, tok = float("nan"), torch.ones(1, 1, dtype=torch.long, device=device)
                else:
                    cache = StaticCache(config=model.config, max_cache_len=ctx + 2 * (args.steps + args.warmup) + 8)
                    pre_s, tok = prefill(model, cache, prompt, args.prefill_chunk, device)
                eager_and_compiled(ctx, "static", cache, tok, pre_s, base, kv_tensor_bytes(cache))
                del cache
                gc.collect()
            if "kvpop" in args.rows:
                model.set_attn_implementation("kvpop")
                for scorer in args.scorers:
                    base = allocated(device)  # caches kept for --paired-repeats are not this row's memory
                    cache = make_cache(f"kvpop-{scorer}")
                    if args.profile_prefill and ctx == profile_ctx:
                        profile_prefill_chunk(model, cache, prompt, args.prefill_chunk, device,
                                              Path(f"{prefix}_prefill_profile_{scorer}_{ctx}.txt"))
                        cache = make_cache(f"kvpop-{scorer}")
                    pre_s, tok = timed_prefill(f"kvpop-{scorer}", cache, prompt)
                    if args.prefill_only:
                        prefill_row(ctx, f"kvpop-{scorer}", cache, pre_s, base, cache.memory_bytes())
                    else:
                        read_b = cache.memory_bytes()
                        snap = eager_and_compiled(ctx, f"kvpop-{scorer}", cache, tok, pre_s, base, read_b)
                        if args.paired_repeats:
                            paired.setdefault(f"kvpop-{scorer}", {})[ctx] = (cache, snap, tok, read_b)
                    del cache
                    gc.collect()
            if "dms" in args.rows and not args.prefill_only:
                model.set_attn_implementation("kvpop")
                base = allocated(device)
                if args.dms_checkpoint:
                    cache = DMSCache.from_pretrained(args.dms_checkpoint, model.config)
                else:
                    cache = DMSCache(model.config, gate=synthetic_dms_gate(model.config, s, w, k, ctx), sinks=s, window=w)
                reset_peak(device)
                pre_s, tok = prefill(model, cache, prompt, args.prefill_chunk, device)
                peak_pre, resident = peak(device) - base, allocated(device) - base
                decode(model, model, cache, tok, args.warmup, device)
                times, _, _ = decode(model, model, cache, tok, args.steps, device)
                kept = float(cache.kept_counts().float().mean())
                record(ctx, 1, "dms", "eager", times, pre_s, max(peak_pre, peak(device) - base), resident,
                       cache.memory_bytes(), kept_per_head=round(kept, 1))
                del cache
                gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_outputs(prefix, rows, notes, head, command, commit, started, args, plot_too=False)

        if args.paired_repeats:
            paired_decode()
            paired.clear()
            gc.collect()

        # eviction share of compiled steps: the same attention length as StaticCache+compile at B tokens
        static_small = [r for r in rows if r["cache"] == "static" and r["mode"] == "compiled"
                        and r["context"] == min(static_ctx)]
        if static_small and min(static_ctx) == B:
            for r in rows:
                if r["mode"] == "compiled" and r["cache"].startswith("kvpop") and r["context"] == min(args.contexts):
                    r["eviction_share"] = round(1 - static_small[0]["decode_ms_median"] / r["decode_ms_median"], 3)

        for batch in args.batches or []:
            ctx = args.batch_context
            extra = args.steps + args.warmup + 8
            names = [n for n in ("dynamic", "static") if n in args.rows]
            batch_scorers = args.scorers if args.batch_scorers is None else args.batch_scorers
            for name in names + ([f"kvpop-{sc}" for sc in batch_scorers] if "kvpop" in args.rows else []):
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                base = allocated(device)
                reset_peak(device)
                cache = None
                try:
                    if name.startswith("kvpop"):
                        model.set_attn_implementation("kvpop")
                        cache = make_cache(name)
                        fill_kvpop(cache, model, torch.ones(batch, ctx + 1, dtype=torch.long, device=device))
                    else:
                        model.set_attn_implementation("sdpa")
                        cache = fill_dense(name, model, batch, ctx, extra, device, dtype)
                    step = model if name == "dynamic" else compiled_call
                    tok = torch.ones(batch, 1, dtype=torch.long, device=device)
                    decode(step, model, cache, tok, args.warmup, device)
                    times, _, _ = decode(step, model, cache, tok, args.steps, device)
                    record(ctx, batch, name, "eager" if name == "dynamic" else "compiled", times, float("nan"),
                           peak(device) - base, allocated(device) - base, cache_bytes(cache), filled="synthetic")
                except torch.OutOfMemoryError:
                    need = 2 * model.config.num_hidden_layers * batch * model.config.num_key_value_heads * \
                        (ctx + extra) * model.config.head_dim * dtype.itemsize
                    notes.append(f"batch {batch} at {ctx}: {name} ran out of GPU memory (its KV alone needs "
                                 f"{need / 1e9:.0f} GB beside {weight_bytes / 1e9:.1f} GB of weights)")
                    print("  " + notes[-1], flush=True)
                del cache
                gc.collect()
            write_outputs(prefix, rows, notes, head, command, commit, started, args, plot_too=False)

        if args.leak_caches:
            model.set_attn_implementation("kvpop")
            prompt = torch.randint(1, vocab, (1, 1024), generator=gen).to(device)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            before = allocated(device)
            for i in range(args.leak_caches):
                cache = make_cache(f"kvpop-{args.scorers[i % len(args.scorers)]}")
                _, tok = prefill(model, cache, prompt, 512, device)
                decode(model, model, cache, tok, 2, device)
                del cache
            after_del = allocated(device)
            gc.collect()
            after_gc = allocated(device)
            notes.append(f"{args.leak_caches} KVpopCaches created, filled (1024-token prompt in 512-token chunks + 2 "
                         f"decode steps) and dropped: allocated {before / 2**20:.1f} MiB before, "
                         f"{after_del / 2**20:.1f} MiB after (no gc.collect), {after_gc / 2**20:.1f} MiB after gc")
            print("  " + notes[-1], flush=True)

    write_outputs(prefix, rows, notes, head, command, commit, started, args)
    return 0


def redraw(csv_path: Path, prefix: Path, args) -> int:
    """Table and plot from a CSV written by this script (e.g. one copied back from a GPU machine)."""
    lines = csv_path.read_text().splitlines()
    meta = dict(line[2:].split(": ", 1) for line in lines if line.startswith("# ") and ": " in line[:20])
    head = next(line[2:] for line in lines if line.startswith("# ") and ": " not in line[:20])
    rows = []
    for r in csv.DictReader(line for line in lines if not line.startswith("#")):
        row = {}
        for key, value in r.items():
            try:
                row[key] = int(value) if key in ("context", "batch") else float(value)
            except (TypeError, ValueError):
                row[key] = value or None
        rows.append(row)
    notes = [line[len("# note: "):] for line in lines if line.startswith("# note: ")]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    args.steps, args.warmup = int(meta.get("steps", args.steps)), int(meta.get("warmup", args.warmup))
    write_outputs(prefix, rows, notes, head, meta["command"], meta["commit"], meta["started"], args)
    return 0


def write_outputs(prefix: Path, rows, notes, head, command, commit, started, args, plot_too=True) -> None:
    fields = []
    for r in rows:
        fields += [f for f in r if f not in fields]
    with open(prefix.with_suffix(".csv"), "w", newline="") as f:
        f.write(f"# command: {command}\n# commit: {commit}\n# started: {started}\n# steps: {args.steps}\n"
                f"# warmup: {args.warmup}\n# {head}\n" + "".join(f"# note: {n}\n" for n in notes))
        wr = csv.DictWriter(f, fieldnames=fields)
        wr.writeheader()
        wr.writerows(rows)
    cols = ["context", "batch", "cache", "mode", "prefill_s", "decode_ms_median", "decode_ms_p90", "tokens_per_s",
            "x_floor", "peak_gb", "resident_gb", "eviction_share", "max_abs_dlogit", "warmup_s"]
    cols += [c for c in ("cache_mb", "kept_per_head", "cudagraph_partitions") if any(c in r for r in rows)]

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))

    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    with open(prefix.with_suffix(".md"), "w") as f:
        f.write(f"# Generation speed and memory\n\nCommand: `{command}`\n\n- commit `{commit}`, started {started}\n"
                f"- {head}\n- decode ms: median and p90 of {args.steps} steps after {args.warmup} untimed ones; "
                "x_floor: median / (weights + cache buffers read once at the measured copy bandwidth); peak/resident: "
                "GB above the weights\n\n" + "\n".join(md) + "\n\n" + "".join(f"- {n}\n" for n in notes))
        if plottable(rows):
            f.write(f"\n![latency and memory vs context]({prefix.name}.png)\n")
    if plot_too:
        plot(rows, prefix.with_suffix(".png"), f"{command}\n{head}")
        print(f"wrote {prefix.with_suffix('.md')}, .csv, .png")


def plottable(rows) -> list:
    """The rows :func:`plot` draws: every row of a prefill-only run, else the decode rows of prefilled batch-1 caches."""
    if rows and all(r["mode"] == "prefill" for r in rows):
        return rows
    return [r for r in rows if r["batch"] == 1 and r.get("filled") != "synthetic"
            and r["mode"] in ("eager", "compiled")]


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rows and all(r["mode"] == "prefill" for r in rows):
        return plot_prefill(rows, path, title)
    single = plottable(rows)
    if not single:
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in dict.fromkeys((r["cache"], r["mode"]) for r in single):
        rs = sorted((r for r in single if (r["cache"], r["mode"]) == key), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        style = "-" if key[1] == "compiled" else "--"
        ax_t.plot(x, [r["decode_ms_median"] for r in rs], style, marker="o", label=f"{key[0]} {key[1]}")
        if key[1] != "compiled":  # one memory curve per cache: both modes hold the same cache
            line = ax_m.plot(x, [r["resident_gb"] for r in rs], "-", marker="o", label=f"{key[0]} resident")[0]
            ax_m.plot(x, [r["peak_gb"] for r in rs], ":", marker="x", color=line.get_color())
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("decode ms/token (median)")
    ax_t.set_ylim(bottom=0)
    ax_m.set_ylabel("GB above the weights: cache held (solid), peak (dotted)")
    ax_m.set_yscale("log")
    ax_m.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 180)), fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prefill(rows, path: Path, title: str) -> None:
    """Prefill seconds and peak memory above the weights vs context, one line per cache (``--prefill-only``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["cache"] for r in rows):
        rs = sorted((r for r in rows if r["cache"] == name), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        ax_t.plot(x, [r["prefill_s"] for r in rs], "-", marker="o", label=name)
        ax_m.plot(x, [r["peak_gb"] for r in rs], "-", marker="o", label=name)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_ylabel("prefill seconds (median)")
    ax_t.set_yscale("log")
    ax_m.set_ylabel("peak GB above the weights")
    fig.suptitle("\n".join(textwrap.wrap(title, 180)), fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
