"""Speed of the running top-k backends: Triton Fenwick kernel vs wavelet matrix (vs torch reference).

    # GPU (H200): the defaults
    python benchmarks/running_topk_speed.py --out results/running_topk_speed_gpu.md
    # CPU smoke test (the triton column needs TRITON_INTERPRET=1 and is very slow: only S <= --triton-cpu-max)
    TRITON_INTERPRET=1 python benchmarks/running_topk_speed.py --device cpu --seq-lens 256,512,2048 \
        --window 16 --repeats 3 --out /tmp/topk_speed.md

Input per S: priorities ``[rows, S] ~ N(0, 1)`` (rows = batch x KV heads), sinks ``--sinks``, window
``--window``, k = ``S / --compression - sinks - window`` (as in ``training_speed.py``) unless ``--topk``.
Each backend: one warm-up call (Triton compiles), one call for peak memory (CUDA), then ``--repeats``
timed calls (CUDA events on GPU, ``time.perf_counter`` on CPU); the median is reported.  The wavelet
result is compared field by field with the Triton result (and with the torch reference where it runs).
The markdown table goes to stdout and to ``--out`` with the command line, git commit and date.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from kvpop_lab.utils.provenance import git_commit  # noqa: E402
from kvpop_lab.utils.timing import fmt, free, measure, quantiles  # noqa: E402
from kvpop_hf.ops.running_topk import running_topk_reference, running_topk_wavelet  # noqa: E402
from kvpop_hf.ops.running_topk import wavelet as wavelet_module  # noqa: E402

FIELDS = ("rank", "cutoff", "boundary", "keep_new")


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, n).cpu(), getattr(b, n).cpu()) for n in FIELDS)


def _time(fn, device, repeats, warmup=True):
    """``(median ms, peak MiB, output)``: one warm-up call, then :func:`kvpop_lab.utils.timing.measure`."""
    if warmup:
        fn()
    peak, times, out = measure(fn, device, repeats)
    return quantiles(times)["median"], peak, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-lens", default="4096,16384,32768,65536", help="comma list of S")
    ap.add_argument("--rows", type=int, default=8, help="rows = batch x KV heads (default 8)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--compression", type=float, default=8.0)
    ap.add_argument("--topk", type=int, default=None, help="fixed k (default S/compression - sinks - window)")
    ap.add_argument("--reference-max", type=int, default=16384, help="torch reference only for S <= this")
    ap.add_argument("--triton-cpu-max", type=int, default=256,
                    help="on CPU (Triton interpreter, ~45 s per call at S=512, 8 rows) the triton column only "
                         "for S <= this, a single call without warm-up")
    ap.add_argument("--triton-max", type=int, default=32768, help="on GPU the triton column only for S <= this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="markdown output path (.md)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    seq_lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    cpu = device.type != "cuda"
    triton_ok, triton_note = True, ""
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        triton_ok, triton_note = False, "triton skipped: CPU without TRITON_INTERPRET=1"
    running_topk_triton = None
    if triton_ok:
        try:
            from kvpop_hf.ops.running_topk import running_topk_triton
        except Exception as err:  # noqa: BLE001  (triton missing / broken: report, keep the rest)
            triton_ok, triton_note = False, f"triton unavailable: {type(err).__name__}: {err}"

    notes = []
    if triton_note:
        notes.append(triton_note)
    if cpu and triton_ok:
        notes.append(f"triton on CPU runs in the Triton interpreter (S <= {args.triton_cpu_max} only, "
                     "a single call, no warm-up; not representative of GPU speed)")
    header = ("| S | rows | k | triton ms | wavelet ms | wavelet ms, no CUDA graph | torch ref ms | triton / wavelet "
              "| wavelet peak MiB | wavelet == triton | wavelet == ref | graph == no graph |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    g = torch.Generator().manual_seed(args.seed)
    for S in seq_lens:
        k = args.topk if args.topk is not None else max(0, int(S / args.compression) - args.sinks - args.window)
        prio = torch.randn(args.rows, S, generator=g).to(device)
        s, w = args.sinks, args.window
        tri_ms = wav_ms = ref_ms = peak = float("nan")
        tri = ref = None
        wav_ms, peak, wav = _time(lambda: running_topk_wavelet(prio, s, w, k), device, args.repeats)
        free(device)
        eager_ms, eager = float("nan"), None
        if not cpu:
            wavelet_module.USE_CUDA_GRAPHS = False
            try:
                eager_ms, _, eager = _time(lambda: running_topk_wavelet(prio, s, w, k), device, args.repeats)
            finally:
                wavelet_module.USE_CUDA_GRAPHS = True
            free(device)
        if triton_ok and (S <= args.triton_cpu_max if cpu else S <= args.triton_max):
            tri_ms, _, tri = _time(lambda: running_topk_triton(prio, s, w, k), device,
                                   1 if cpu else args.repeats, warmup=not cpu)
            free(device)
        if S <= args.reference_max:
            ref_ms, _, ref = _time(lambda: running_topk_reference(prio, s, w, k), device, args.repeats)
            free(device)
        eq_tri = "-" if tri is None else ("yes" if _same(wav, tri) else "**NO**")
        eq_ref = "-" if ref is None else ("yes" if _same(wav, ref) else "**NO**")
        eq_eager = "-" if eager is None else ("yes" if _same(wav, eager) else "**NO**")
        ratio = tri_ms / wav_ms if tri is not None else float("nan")
        row = (f"| {S} | {args.rows} | {k} | {fmt(tri_ms)} | {fmt(wav_ms)} | {fmt(eager_ms)} | {fmt(ref_ms)} "
               f"| {fmt(ratio, 1)} | {fmt(peak, 1)} | {eq_tri} | {eq_ref} | {eq_eager} |")
        lines.append(row)
        print(row, flush=True)
        del wav, tri, ref, prio, eager
        free(device)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = [
        "# Running top-k speed: triton (Fenwick) vs wavelet vs torch reference",
        "",
        f"- command: `{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}`",
        f"- git commit: {git_commit(REPO)}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- device: {dev_name}; torch {torch.__version__}; threads {torch.get_num_threads()}",
        f"- input: prio [{args.rows}, S] ~ N(0, 1), sinks {args.sinks}, window {args.window}, "
        + (f"k {args.topk}" if args.topk is not None else f"k = S/{args.compression:g} - sinks - window"),
        f"- timing: 1 warm-up, median of {args.repeats} "
        + ("(CUDA events)" if device.type == "cuda" else "(perf_counter)")
        + f"; torch reference only for S <= {args.reference_max}; '-' = not run",
        *[f"- note: {n}" for n in notes],
        "",
    ]
    text = "\n".join(meta + lines) + "\n"
    print()
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
