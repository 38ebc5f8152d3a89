"""KVpopCache with a model split across devices (an accelerate device map) against the same model on one.

    # two GPUs, Qwen3-8B shapes with random bf16 weights: layers split half and half
    python benchmarks/split_model_generation.py --devices cuda:0 cuda:1 --shape qwen3-8b --context 32768 \
        --out-prefix results/split_model_generation/h200x2_qwen3-8b
    # CPU smoke run (tiny shape, both halves on the CPU)
    python benchmarks/split_model_generation.py --devices cpu cpu --shape tiny --context 256 --new-tokens 16

The model (random weights, seeded) is built once. Run 1 keeps it on ``--devices[0]``; run 2 dispatches it
with ``accelerate.dispatch_model``: embeddings and the first half of the layers on the first device, the
rest, the final norm and the LM head on the second. Each run prefills the same prompt with a fresh
KVpopCache (``attn_implementation="kvpop"``, ``--prefill-chunk`` token chunks) and decodes ``--new-tokens``
greedy tokens eagerly (``--compiled`` adds decoding through ``model.get_compiled_call``, the call
``generate`` makes). Printed and written (markdown + CSV with command and commit): prefill seconds, decode
ms/token (median, p90), whether the split run's tokens equal the single-device ones, and, per layer,
whether its cache buffers and its scorer copy live on that layer's device (nothing moves per step).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]

from kvpop_lab.bench.generation_speed import SHAPES, build_model  # noqa: E402

from kvpop_hf import KVpopCache  # noqa: E402
from kvpop_hf.cli.budget_flags import add_budget_flags  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_lab.utils.provenance import git_commit, versions  # noqa: E402
from kvpop_lab.utils.timing import quantiles  # noqa: E402


def sync_all(devices) -> None:
    for d in {torch.device(x) for x in devices}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def split_map(model, first: str, second: str) -> dict[str, str]:
    """Embeddings and the first half of the layers on ``first``; the rest, the norm and the head on ``second``."""
    n = model.config.num_hidden_layers
    dm = {"model.embed_tokens": first, "model.rotary_emb": first}
    dm.update({f"model.layers.{i}": first if i < n // 2 else second for i in range(n)})
    dm.update({"model.norm": second, "lm_head": second})
    return dm


def layer_devices(model) -> list[torch.device]:
    return [next(layer.parameters()).device for layer in model.model.layers]


def placement_report(cache: KVpopCache, devices: list[torch.device]) -> dict:
    """Per layer: the cache buffers and the scorer copy on the layer's own device; distinct scorer copies."""
    buffers_ok, scorer_ok = [], []
    for layer, dev in zip(cache.layers, devices):
        buffers_ok.append(all(t.device == dev for t in layer._buffers()))
        params = list(layer.scorer.parameters())
        scorer_ok.append(all(p.device == dev for p in params))
    copies = len({id(layer.scorer) for layer in cache.layers})
    return {"buffers_on_layer_device": all(buffers_ok), "scorer_on_layer_device": all(scorer_ok),
            "scorer_copies": copies}


def run(model, prompt, args, devices, step=None) -> dict:
    """Prefill + greedy decode with a fresh cache; returns tokens, timings and placement."""
    s, w, k = args.sinks, args.window, args.topk
    cache = KVpopCache(model.config, sinks=s, window=w, topk=k, scorer=args.scorer)
    first = torch.device(devices[0])
    ids = prompt.to(first)
    with torch.inference_mode():
        sync_all(devices)
        t0 = time.perf_counter()
        logits = None
        for start in range(0, ids.shape[1], args.prefill_chunk):
            logits = model(input_ids=ids[:, start:start + args.prefill_chunk],
                           **with_cache(model, cache, use_cache=True, logits_to_keep=1)).logits
        sync_all(devices)
        prefill_s = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True).to(first)
        call = step or model
        times, toks = [], [tok]
        for _ in range(args.new_tokens):
            sync_all(devices)
            t0 = time.perf_counter()
            out = call(input_ids=tok, **with_cache(model, cache, use_cache=True, logits_to_keep=1)).logits[:, -1]
            sync_all(devices)
            times.append((time.perf_counter() - t0) * 1e3)
            tok = out.argmax(-1, keepdim=True).to(first)
            toks.append(tok)
    timed = sorted(times[args.warmup:]) or sorted(times)
    q = quantiles(timed)
    return {"tokens": torch.cat(toks, 1).cpu(), "prefill_s": prefill_s, "decode_ms_median": q["median"],
            "decode_ms_p90": q["p90"], **placement_report(cache, layer_devices(model))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs=2, default=["cuda:0", "cuda:1"], metavar=("FIRST", "SECOND"))
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8, help="decode steps left out of the timing")
    add_budget_flags(ap, sinks=4, window=256, topk=3836)
    ap.add_argument("--scorer", default="mlstm")
    ap.add_argument("--compiled", action="store_true", help="also decode through model.get_compiled_call")
    ap.add_argument("--out-prefix", default=None)
    args = ap.parse_args(argv)
    for name in ("context", "prefill_chunk", "new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.warmup < 0 or args.warmup >= args.new_tokens:
        raise ValueError(f"--warmup must be in [0, --new-tokens), got {args.warmup}.")

    first = torch.device(args.devices[0])
    dtype = getattr(torch, args.dtype or ("bfloat16" if first.type == "cuda" else "float32"))
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) \
        if argv is None else f"main({argv!r})"
    commit = git_commit(REPO)
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    model = build_model(args.shape, first, dtype, args.context + args.new_tokens + 64)
    model.set_attn_implementation("kvpop")
    prompt = torch.randint(1, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))

    rows = []
    one = run(model, prompt, args, [first])
    rows.append({"placement": f"one device ({first})", "mode": "eager", **one})
    if args.compiled:
        from transformers import CompileConfig

        step = model.get_compiled_call(CompileConfig())
        rows.append({"placement": f"one device ({first})", "mode": "compiled",
                     **run(model, prompt, args, [first], step)})

    from accelerate import dispatch_model

    model = dispatch_model(model, device_map=split_map(model, *args.devices))
    split = run(model, prompt, args, args.devices)
    rows.append({"placement": "split " + " + ".join(args.devices), "mode": "eager", **split})
    if args.compiled:
        from transformers import CompileConfig

        torch._dynamo.reset()
        step = model.get_compiled_call(CompileConfig())
        rows.append({"placement": "split " + " + ".join(args.devices), "mode": "compiled",
                     **run(model, prompt, args, args.devices, step)})

    base = rows[0]["tokens"]
    for r in rows:
        r["same_tokens_as_one_device_eager"] = bool(torch.equal(r.pop("tokens"), base))
        print(f"  {r['placement']:<28} {r['mode']:<8} prefill {r['prefill_s']:.2f} s  decode "
              f"{r['decode_ms_median']:.2f} ms (p90 {r['decode_ms_p90']:.2f})  same tokens "
              f"{r['same_tokens_as_one_device_eager']}  buffers/scorer on layer device "
              f"{r['buffers_on_layer_device']}/{r['scorer_on_layer_device']}  scorer copies {r['scorer_copies']}",
              flush=True)

    if args.out_prefix:
        prefix = Path(args.out_prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        env = versions("torch", "transformers", "accelerate")
        head = (f"{args.shape} random {str(dtype)[6:]}; context {args.context}, {args.prefill_chunk}-token chunks; "
                f"B = {args.sinks}+{args.window}+{args.topk}; scorer {args.scorer}; {args.new_tokens} new tokens, "
                f"decode timed after {args.warmup}; " + ", ".join(f"{k} {v}" for k, v in env.items()))
        with open(prefix.with_suffix(".csv"), "w", newline="") as f:
            f.write(f"# command: {command}\n# commit: {commit}\n# started: {started}\n# {head}\n")
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        cols = list(rows[0])
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |"
               for r in rows]
        prefix.with_suffix(".md").write_text(
            f"# KVpopCache with a split model\n\nCommand: `{command}`\n\n- commit `{commit}`, started {started}\n"
            f"- {head}\n\n" + "\n".join(md) + "\n")
        print(f"wrote {prefix.with_suffix('.md')}, .csv")
    return 0 if all(r["same_tokens_as_one_device_eager"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
