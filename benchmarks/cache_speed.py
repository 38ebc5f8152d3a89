"""Decode time per token and cache bytes vs context length: DynamicCache vs KVpopCache.

    python benchmarks/cache_speed.py                                  # CPU defaults (~minutes on 2 cores)
    python benchmarks/cache_speed.py --contexts 1024 4096 16384 --steps 64 --repeats 7
    python benchmarks/cache_speed.py --device cuda --dtype bfloat16 --contexts 4096 16384 65536 \
        --hidden 2048 --layers 16 --heads 16 --kv-heads 8 --head-dim 128 --out-prefix results/cache_speed_cuda

For each context length the script builds one cache of every kind (DynamicCache, and a KVpopCache per
scorer), prefills each with the same random prompt in chunks (so prefill memory stays bounded), then
measures greedy decode steps *side by side*: ``--repeats`` rounds, each round running ``--steps`` decode
steps on every cache in turn, so slow drifts of the machine (other processes, clocks) hit all caches
alike. Reported per cache: median / p10 / p90 of the per-step times over all rounds, the cache's tensor
bytes (``KVpopCache.memory_bytes()``: keys, values, positions, priorities, scorer state; DynamicCache:
its key and value tensors) and, on CUDA, the peak memory allocated above the pre-existing allocations
while prefilling / decoding that cache.

DynamicCache runs the model with ``attn_implementation="sdpa"`` (the stock path); KVpopCache runs it with
``"kvpop"`` (exact per-head budget inside prefill chunks; plain SDPA over the B stored entries when
decoding). The model is a random-init Qwen3 (no download); weights do not affect timings.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from kvpop_lab.utils.provenance import git_commit, versions
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

from kvpop_hf import KVpopCache
from kvpop_hf.cache import kv_tensor_bytes
from kvpop_hf.compat import with_cache
from kvpop_lab.utils.timing import sync

REPO = Path(__file__).resolve().parents[1]
# transformers >= 5.2x renames generate/forward's `past_key_values` to `cache`; the old name still works
# and is the one every supported version (>= 5.17) accepts.
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated.*", category=FutureWarning)


# ----------------------------------------------------------------------------------------- provenance
def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    vers = versions("torch", "transformers")
    info = {
        "platform": platform.platform(),
        "python": vers["python"],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": vers["torch"],
        "transformers": vers["transformers"],
    }
    try:
        info["load_avg_1_5_15_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


# ----------------------------------------------------------------------------------------- model / caches
def build_model(args, device, dtype):
    torch.manual_seed(args.seed)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=max(args.contexts) + args.warmup + args.steps * args.repeats + 16,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


class Runner:
    """One cache under test: its attention implementation, the token it decodes next, its timings."""

    def __init__(self, name, cache, attn, scorer="", budget=None):
        self.name, self.cache, self.attn, self.scorer, self.budget = name, cache, attn, scorer, budget
        self.next_tok = None
        self.step_times: list[float] = []
        self.prefill_s = 0.0
        self.peak_prefill = None
        self.peak_decode = 0
        self.bytes_at_prefill = self.kv_bytes_at_prefill = self.stored_at_prefill = 0

    def bytes(self) -> int:
        if isinstance(self.cache, KVpopCache):
            return self.cache.memory_bytes()
        return kv_tensor_bytes(self.cache)

    def kv_bytes(self) -> int:
        return kv_tensor_bytes(self.cache)

    def stored_tokens(self) -> int:
        if isinstance(self.cache, KVpopCache):
            return int((self.cache.stored_positions(0) >= 0).sum(-1).max())
        return self.cache.get_seq_length()


def make_runners(model, args):
    runners = [Runner("dynamic", DynamicCache(config=model.config), "sdpa")]
    for scorer in args.scorers:
        cache = KVpopCache(model.config, sinks=args.sinks, window=args.window, topk=args.topk, scorer=scorer)
        runners.append(Runner(f"kvpop-{scorer}", cache, "kvpop", scorer, cache.budget))
    return runners


def forward(model, ids, cache):
    out = model(input_ids=ids, **with_cache(model, cache, use_cache=True, logits_to_keep=1))
    return out.logits[:, -1].argmax(-1, keepdim=True)


def reset_peak(device) -> int:
    """Synchronise, reset the CUDA peak-memory counter and return the bytes allocated now."""
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def prefill(model, runner, prompt, chunk, device):
    model.set_attn_implementation(runner.attn)
    cuda = device.type == "cuda"
    base = reset_peak(device) if cuda else 0
    t0 = time.perf_counter()
    tok = None
    for start in range(0, prompt.shape[1], chunk):
        tok = forward(model, prompt[:, start:start + chunk], runner.cache)
    sync(device)
    runner.prefill_s = time.perf_counter() - t0
    runner.next_tok = tok
    runner.bytes_at_prefill, runner.kv_bytes_at_prefill = runner.bytes(), runner.kv_bytes()
    runner.stored_at_prefill = runner.stored_tokens()
    if cuda:
        runner.peak_prefill = torch.cuda.max_memory_allocated(device) - base


def decode(model, runner, steps, device, record=True):
    model.set_attn_implementation(runner.attn)
    cuda = device.type == "cuda"
    base = reset_peak(device) if cuda else 0
    tok = runner.next_tok
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        tok = forward(model, tok, runner.cache)
        sync(device)
        if record:
            runner.step_times.append(time.perf_counter() - t0)
    runner.next_tok = tok
    if cuda and record:
        runner.peak_decode = max(runner.peak_decode, torch.cuda.max_memory_allocated(device) - base)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ----------------------------------------------------------------------------------------- output
def fmt_mib(n):
    return f"{n / 2**20:.2f}"


def table(rows, device):
    cols = ["context", "cache", "budget", "stored", "cache_MiB", "kv_MiB", "prefill_s", "ms/tok med", "p10", "p90",
            "vs dynamic"]
    if device.type == "cuda":
        cols += ["peak_prefill_MiB", "peak_decode_MiB"]
    lines = [cols]
    for r in rows:
        line = [str(r["context"]), r["cache"], str(r["budget"] or "-"), str(r["stored_tokens"]),
                fmt_mib(r["cache_bytes"]), fmt_mib(r["kv_bytes"]), f"{r['prefill_s']:.2f}",
                f"{r['ms_per_token_median']:.2f}", f"{r['ms_per_token_p10']:.2f}", f"{r['ms_per_token_p90']:.2f}",
                f"{r['speed_vs_dynamic']:.2f}x"]
        if device.type == "cuda":
            line += [fmt_mib(r["peak_prefill_bytes"]), fmt_mib(r["peak_decode_bytes"])]
        lines.append(line)
    widths = [max(len(l[i]) for l in lines) for i in range(len(cols))]
    text = ["  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    md = ["| " + " | ".join(lines[0]) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    md += ["| " + " | ".join(l) + " |" for l in lines[1:]]
    return "\n".join(text), "\n".join(md)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["cache"] for r in rows):
        rs = sorted((r for r in rows if r["cache"] == name), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        ax_m.plot(x, [r["cache_bytes"] / 2**20 for r in rs], marker="o", label=name)
        med = [r["ms_per_token_median"] for r in rs]
        ax_t.plot(x, med, marker="o", label=name)
        ax_t.plot(x, [r["ms_per_token_p10"] for r in rs], ls="--", lw=1, color=ax_t.lines[-1].get_color())
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_m.set_yscale("log")
    ax_m.set_ylabel("cache tensor memory (MiB)")
    ax_m.set_title("cache memory vs context")
    ax_t.set_ylabel("decode ms/token (solid: median, dashed: p10)")
    ax_t.set_title("decode latency vs context")
    ax_t.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per cache per round")
    ap.add_argument("--repeats", type=int, default=8, help="rounds (each runs --steps on every cache in turn)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps per cache after prefill")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--topk", type=int, default=380)
    ap.add_argument("--scorers", nargs="+", default=["knorm", "mlstm"])
    g = ap.add_argument_group("random-init Qwen3 shape")
    g.add_argument("--vocab", type=int, default=1024)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--intermediate", type=int, default=0, help="0: 2 x hidden")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-prefix", default=None,
                    help="write PREFIX.md/.csv/.png (default results/cache_speed_<device type>)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda requested but CUDA is not available")
    dtype = getattr(torch, args.dtype)
    prefix = Path(args.out_prefix or REPO / "results" / f"cache_speed_{device.type}")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) \
        if argv is None else "main(" + repr(argv) + ")"
    commit = git_commit(REPO)
    info = machine_info(device)
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    t_start = time.perf_counter()

    model = build_model(args, device, dtype)
    budget = args.sinks + args.window + args.topk
    print(f"model: random-init Qwen3 {args.layers} layers, hidden {args.hidden}, {args.heads} q / {args.kv_heads} KV "
          f"heads x {args.head_dim}, vocab {args.vocab}, {args.dtype} on {device}; KVpop budget "
          f"B = {args.sinks}+{args.window}+{args.topk} = {budget}; {args.repeats} rounds x {args.steps} steps per cache")
    print(f"commit {commit}; torch {torch.__version__}; transformers {transformers.__version__}; "
          f"{info['cpu_count']} CPUs, {info['torch_threads']} torch threads", flush=True)

    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        for ctx in args.contexts:
            prompt = torch.randint(1, args.vocab, (args.batch, ctx), generator=gen).to(device)
            runners = make_runners(model, args)
            for r in runners:
                prefill(model, r, prompt, args.prefill_chunk, device)
                decode(model, r, args.warmup, device, record=False)
            for i in range(args.repeats):  # side by side: every round visits every cache (rotating order)
                for r in runners[i % len(runners):] + runners[:i % len(runners)]:
                    decode(model, r, args.steps, device)
            dyn_med = None
            for r in runners:
                med = statistics.median(r.step_times) * 1e3
                dyn_med = med if r.name == "dynamic" else dyn_med
                rows.append({
                    "device": str(device), "dtype": args.dtype, "context": ctx, "cache": r.name, "scorer": r.scorer,
                    "budget": r.budget, "stored_tokens": r.stored_at_prefill, "cache_bytes": r.bytes_at_prefill,
                    "kv_bytes": r.kv_bytes_at_prefill, "prefill_s": r.prefill_s,
                    "ms_per_token_median": med, "ms_per_token_p10": pct(r.step_times, 0.1) * 1e3,
                    "ms_per_token_p90": pct(r.step_times, 0.9) * 1e3, "timed_steps": len(r.step_times),
                    "speed_vs_dynamic": (dyn_med / med) if dyn_med else float("nan"),
                    "seen_tokens_end": r.cache.get_seq_length(), "stored_tokens_end": r.stored_tokens(),
                    "cache_bytes_end": r.bytes(),
                    "peak_prefill_bytes": r.peak_prefill, "peak_decode_bytes": r.peak_decode if device.type == "cuda" else None,
                })
                print(f"  ctx {ctx:>6}  {r.name:<14} {med:8.2f} ms/tok  cache {fmt_mib(rows[-1]['cache_bytes']):>8} MiB  "
                      f"prefill {r.prefill_s:6.2f} s", flush=True)
            del runners
            if device.type == "cuda":
                torch.cuda.empty_cache()

    elapsed = time.perf_counter() - t_start
    try:  # other processes on the machine inflate CPU timings: record the load before and after
        info["load_avg_1_5_15_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    txt, md = table(rows, device)
    print()
    print(txt)
    print(f"\n('vs dynamic' = DynamicCache median ms/token / this cache's; > 1 means faster. total {elapsed:.0f} s)")

    fields = list(rows[0])
    with open(prefix.with_suffix(".csv"), "w", newline="") as f:
        for k, v in [("command", command), ("commit", commit), ("started", started), *info.items()]:
            f.write(f"# {k}: {v}\n")
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    title = (f"{command}\ncommit {commit[:12]}, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{info.get('gpu', info['cpu'])} ({info['cpu_count']} CPUs)")
    if not args.no_plot:
        plot(rows, prefix.with_suffix(".png"), title)
    with open(prefix.with_suffix(".md"), "w") as f:
        f.write(f"# Cache decode speed and memory vs context ({device.type})\n\n")
        f.write(f"Command: `{command}`\n\n")
        f.write(f"- commit: `{commit}` (working tree may contain uncommitted changes)\n- started: {started}; "
                f"total {elapsed:.0f} s\n")
        for k, v in info.items():
            f.write(f"- {k}: {v}\n")
        f.write(f"- model: random-init Qwen3, {args.layers} layers, hidden {args.hidden}, {args.heads} q heads / "
                f"{args.kv_heads} KV heads x head_dim {args.head_dim}, vocab {args.vocab}, {args.dtype}, batch "
                f"{args.batch}\n")
        f.write(f"- KVpop budget: sinks {args.sinks} + window {args.window} + topk {args.topk} = {budget}; "
                f"scorers {', '.join(args.scorers)} (untrained weights for learned scorers: timings only)\n")
        f.write(f"- protocol: chunked prefill ({args.prefill_chunk} tokens/chunk), {args.warmup} untimed decode steps, "
                f"then {args.repeats} rounds x {args.steps} greedy decode steps per cache, caches interleaved "
                f"round by round; ms/token = median (p10, p90) over all timed steps"
                + ("; CUDA synchronised around every step" if device.type == "cuda" else "") + "\n")
        f.write("- DynamicCache runs with attn_implementation='sdpa', KVpopCache with 'kvpop'\n")
        f.write("- cache_MiB: KVpop `memory_bytes()` (keys, values, positions, priorities, scorer state); "
                "DynamicCache key+value tensors; measured right after prefill (stored = entries per head then). "
                "kv_MiB: keys+values only. The CSV also has the values after the timed steps (*_end)."
                + (" peak_*: torch.cuda.max_memory_allocated above what was allocated before that phase." if
                   device.type == "cuda" else "") + "\n\n")
        f.write(md + "\n\n")
        f.write("'vs dynamic' = DynamicCache median ms/token divided by this cache's (> 1: faster than DynamicCache).\n\n")
        if not args.no_plot:
            f.write(f"![plot]({prefix.with_suffix('.png').name})\n")
    print(f"wrote {prefix.with_suffix('.md')}, {prefix.with_suffix('.csv')}"
          + ("" if args.no_plot else f", {prefix.with_suffix('.png')}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
