"""Time the split-KV decode attention (kvpop_hf.ops.decode_attention) over launch configurations on one GPU.

One decode step's attention of one layer at a given shape (default: Qwen3-8B, batch 1, ``B = 4096`` slots, all
occupied): ``decode_attention_triton`` (the split kernel and the merge of the splits) captured in a CUDA graph
and timed by ``triton.testing.do_bench_cudagraph`` (median microseconds), for every combination of the slots per
tile (``--block-n``), the split target (``--programs``: about this many programs in all), ``--num-warps`` and
``--num-stages``. Eager, the merge is several small kernels; ``--compiled`` times the function compiled by
torch.compile, as in a compiled decode step (inductor fuses the merge). Each configuration is checked against ``decode_attention_reference`` first. The row of the
repository's default configuration is marked; the table also gives the bandwidth reached (keys and values read
once).

    python benchmarks/decode_attention_configs.py --out results/generation_speed/h200_decode_attention_configs.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from kvpop_hf.ops import decode_attention as da  # noqa: E402
from kvpop_lab.utils.provenance import git_commit  # noqa: E402


def time_config(q, k, v, seen, block_n, programs, num_warps, num_stages, reps, compiled=False):
    import triton

    b, hkv = k.shape[0], k.shape[1]
    splits = max(1, round(programs / (b * hkv)))

    def attend(q, k, v, seen):
        return da.decode_attention_triton(q, k, v, seen, None, splits=splits, block_n=block_n, num_warps=num_warps,
                                          num_stages=num_stages)

    step = torch.compile(attend, fullgraph=True) if compiled else attend

    def fn():
        return step(q, k, v, seen)

    ref = da.decode_attention_reference(q, k, v, seen, None)
    torch.testing.assert_close(fn(), ref, atol=2e-2, rtol=2e-2)
    times = [triton.testing.do_bench_cudagraph(fn, rep=reps) for _ in range(3)]
    return 1000 * statistics.median(times), da.split_count(b * hkv, k.shape[2], block_n, b * hkv * splits)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--programs", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--compiled", action="store_true", help="time torch.compile(decode_attention_triton)")
    ap.add_argument("--reps", type=int, default=50, help="milliseconds per do_bench_cudagraph measurement")
    ap.add_argument("--out", default=None, help="markdown table to write")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention_configs.py times CUDA kernels: run it on a machine with a GPU.")
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    b, hq, hkv, B, d = args.batch, args.q_heads, args.kv_heads, args.slots, args.head_dim
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(b, hkv, B, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(b, hkv, B, d, device=dev, dtype=dt, generator=g)
    seen = torch.full((b,), B, device=dev, dtype=torch.int64)
    gbytes = 2 * k.numel() * k.element_size() / 1e9
    rows = []
    for block_n, programs, warps, stages in itertools.product(args.block_n, args.programs, args.num_warps,
                                                              args.num_stages):
        try:
            us, ns = time_config(q, k, v, seen, block_n, programs, warps, stages, args.reps, args.compiled)
        except Exception as err:  # a configuration Triton cannot build (e.g. out of shared memory)
            print(f"block_n {block_n} programs {programs} warps {warps} stages {stages}: {type(err).__name__}")
            continue
        default = (block_n, programs, warps, stages) == (da._BLOCK_N, da._PROGRAMS, 4, 3)
        rows.append(dict(block_n=block_n, programs=programs, splits=ns, num_warps=warps, num_stages=stages,
                         us=round(us, 2), tb_s=round(gbytes / (us * 1e-6) / 1e3, 2), default=default))
        print(f"block_n {block_n:4d} programs {programs:4d} splits {ns:3d} warps {warps} stages {stages}: "
              f"{us:7.2f} us{'  (default)' if default else ''}", flush=True)
    rows.sort(key=lambda r: r["us"])
    cols = ["block_n", "programs", "splits", "num_warps", "num_stages", "us", "tb_s", "default"]
    lines = [f"# Split-KV decode attention launch configurations ({torch.cuda.get_device_name(0)})", "",
             f"- command: `python benchmarks/decode_attention_configs.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
             f"- commit: {git_commit(ROOT)}", f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- shape: batch {b}, {hq} query / {hkv} KV heads, {B} slots, head dim {d}, bf16; {gbytes * 1e3:.1f} MB "
             "of keys and values; `us`: median of three do_bench_cudagraph medians (kernel and merge, "
             + ("compiled" if args.compiled else "eager: the merge unfused") + ")", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
