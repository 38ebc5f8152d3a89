"""Warm a machine's compile cache before serving: ``kvpop-warm-compile``.

On CUDA, ``model.generate`` compiles the decode step of a ``KVpopCache`` (and of a ``StaticCache``) in every
new process, about a minute for an 8B model. This command runs one short ``generate`` per (scorer, batch size)
you serve with :func:`kvpop_hf.compile_cache.enable_compile_cache` on, then writes the portable bundle
(:func:`kvpop_hf.compile_cache.save_compile_cache`). Serving processes that call
``enable_compile_cache(DIR)`` first then load the compiled graphs and kernels instead of building them::

    kvpop-warm-compile --model Qwen/Qwen3-8B --cache-dir /var/cache/kvpop \\
        --scorer your-org/kvpop-qwen3-8b knorm --batches 1 8 32

Each scorer, budget, batch size, dtype and compile mode (``--compile-mode max-autotune`` when the serving processes
pass ``compile_config=CompileConfig(mode="max-autotune")``) is its own compiled graph, so warm every combination
you serve (``--fuse-projections`` when the serving processes run
:func:`kvpop_hf.ops.fused_projections.fuse_projection_storage` and pass ``fused_compile_config(mode)``); the prompt
length does not matter (the cache's buffers have ``B`` slots whatever the context). Weights
are never changed; ``--random-weights`` builds the model from its config instead (same graphs, no download of the
weights). Scorers are names of :data:`kvpop_hf.scorers.SCORERS` (at ``--sinks``, ``--window`` and ``--topk``,
default 4, 256 and 3836) or KVpop checkpoints (a directory or a Hub repo id, at their own budget but for those of
the three flags given; ``--sinks``/``--window`` other than a checkpoint's trained ones are refused). Each run first
feeds a prompt of two evicting chunks of ``--prefill-chunk`` tokens, so the prompt chunks' FlexAttention (one
dynamic-shape graph per batch size) is in the bundle too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .cli.budget_flags import add_budget_flags

__all__ = ["main", "warm"]


DEFAULT_BUDGET = {"sinks": 4, "window": 256, "topk": 3836}  # of a scorer given by name
DEFAULT_PREFILL_CHUNK = 1024  # tokens per chunk of the warm-up prefill (its graph has dynamic shapes)


def _build_cache(model, scorer: str, overrides: dict):
    """A scorer name's cache at ``DEFAULT_BUDGET`` updated by ``overrides``; a checkpoint's at its own."""
    from .cache import KVpopCache
    from .scorers import SCORERS

    if scorer in SCORERS:
        return KVpopCache(model.config, **{**DEFAULT_BUDGET, **overrides}, scorer=scorer)
    return KVpopCache.from_pretrained(scorer, model.config, **overrides)


def warm(model, cache_dir: str | os.PathLike, scorers: list[str], batches: list[int], sinks: int | None = None,
         window: int | None = None, topk: int | None = None, prompt_tokens: int = 16, new_tokens: int = 4,
         progress: bool = True, compile_mode: str | None = None,
         fuse_projections: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> tuple[list[dict], Path | None]:
    """One greedy ``generate`` of ``new_tokens`` per (scorer, batch) with the compile cache ``cache_dir`` on, then
    the bundle written. The model must already be on its device. ``sinks``, ``window``, ``topk``: the budget of the
    caches (None: a checkpoint's own, else ``DEFAULT_BUDGET``'s). ``compile_mode``: generate's
    ``compile_config=CompileConfig(mode=...)`` (None: transformers' default), the one the serving processes pass.
    ``fuse_projections``: store the model's q/k/v and gate/up weights as one buffer each (in place) and compile with
    ``fused_compile_config(compile_mode)``, as serving processes that fuse them do.
    ``prefill_chunk``: before each ``generate``, a prompt of ``B + 2 * prefill_chunk + 1`` random tokens is fed by
    :func:`~kvpop_hf.prefill.prefill_in_chunks` in chunks of that size (two chunks evict), which compiles the
    FlexAttention of prompt chunks (one dynamic-shape graph per batch size: batch 1 is its own) into the cache;
    0 skips it.
    Returns one record per run (``scorer``, ``batch``, ``prefill_s``: the chunked prefill, ``seconds``: the
    ``generate`` call, compilation included) and the bundle's path (None: nothing compiled)."""
    from tqdm.auto import tqdm
    from transformers import CompileConfig

    from .compat import with_cache
    from .compile_cache import enable_compile_cache, save_compile_cache
    from .prefill import prefill_in_chunks

    enable_compile_cache(cache_dir)
    device = next(model.parameters()).device
    model.set_attn_implementation("kvpop")
    records = []
    extra = {} if compile_mode is None else {"compile_config": CompileConfig(mode=compile_mode)}
    if fuse_projections:
        from .ops.fused_projections import fuse_projection_storage, fused_compile_config

        fuse_projection_storage(model)
        extra = {"compile_config": fused_compile_config(compile_mode)}
    overrides = {k: v for k, v in (("sinks", sinks), ("window", window), ("topk", topk)) if v is not None}
    combos = [(s, b) for s in scorers for b in batches]
    for scorer, batch in tqdm(combos, desc="warming the compile cache", disable=not progress):
        cache = _build_cache(model, scorer, overrides)
        prefill_s = 0.0
        if prefill_chunk:
            long_ids = torch.randint(1, model.config.vocab_size, (batch, cache.budget + 2 * prefill_chunk + 1),
                                     device=device)
            t0 = time.perf_counter()
            prefill_in_chunks(model, cache, long_ids, prefill_chunk)
            prefill_s = round(time.perf_counter() - t0, 2)
            cache.reset()  # the same cache (its checkpoint read once) serves the generate below
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt_tokens), device=device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0, **with_cache(model, cache), **extra)
        records.append({"scorer": scorer, "batch": batch, "prefill_s": prefill_s,
                        "seconds": round(time.perf_counter() - t0, 2)})
    return records, save_compile_cache(cache_dir)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpop-warm-compile", description=__doc__.split("\n\n")[0],
                                 epilog="docs/usage.md, 'Compile once per machine'")
    ap.add_argument("--model", required=True, help="a model directory or Hub repo id (AutoModelForCausalLM)")
    ap.add_argument("--cache-dir", required=True, help="the compile cache directory the serving processes will use")
    ap.add_argument("--scorer", nargs="+", default=["knorm"], help="scorer names or KVpop checkpoints")
    add_budget_flags(ap, sinks=None, window=None, topk=None,
                     default_note="default: a checkpoint's own, else sinks 4, window 256, topk 3836")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=4, help="tokens per warm-up generation (>= 3)")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                    help="chunk size of the warm-up prefill that compiles the prompt chunks' FlexAttention (0: skip)")
    ap.add_argument("--random-weights", action="store_true", help="build the model from its config (no weights read)")
    ap.add_argument("--compile-mode", default=None, choices=["reduce-overhead", "max-autotune"],
                    help="the CompileConfig mode the serving processes pass to generate (default: transformers' own)")
    ap.add_argument("--fuse-projections", action="store_true",
                    help="q/k/v and gate/up as one matrix product each (kvpop_hf.ops.fused_projections), as the serving "
                         "processes compile them")
    return ap


def _check(args) -> None:
    """Bad input is refused before the model is loaded."""
    if Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise SystemExit(f"kvpop-warm-compile: --cache-dir {args.cache_dir!r} is a file; give a directory.")
    if any(b < 1 for b in args.batches):
        raise SystemExit(f"kvpop-warm-compile: --batches must be positive, got {args.batches}.")
    if args.prefill_chunk < 0 or args.prefill_chunk in range(1, 256):
        raise SystemExit(f"kvpop-warm-compile: --prefill-chunk must be 0 (skip) or at least 256 (two 128-query "
                         f"blocks, so the graph serves every longer chunk), got {args.prefill_chunk}.")
    if args.new_tokens < 3:
        raise SystemExit("kvpop-warm-compile: --new-tokens must be >= 3 (the first token is the prompt's; the "
                         "second compiles the decode step; the third replays it).")
    from .config import KVpopConfig

    for name in DEFAULT_BUDGET:
        value = getattr(args, name)
        if value is not None:
            try:
                KVpopConfig(**{**DEFAULT_BUDGET, name: value}).validate()
            except ValueError as err:
                raise SystemExit(f"kvpop-warm-compile: --{name} {value}: {err}") from None
    from .scorers import SCORERS

    for s in args.scorer:
        if s in SCORERS and SCORERS[s].dynamic:
            raise SystemExit(f"kvpop-warm-compile: --scorer {s!r} re-scores entries from the attention every step; its "
                             "cache is not compileable, so there is nothing to warm.")
        if s not in SCORERS and not Path(s).is_dir() and "/" not in s:
            raise SystemExit(f"kvpop-warm-compile: --scorer {s!r} is neither a scorer name ({', '.join(sorted(SCORERS))}) "
                             "nor a checkpoint directory or Hub repo id.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("kvpop-warm-compile: --device cuda but torch sees no GPU. generate compiles decode steps on "
                         "CUDA only, so warm the cache on the serving machine (or a twin of it).")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    _check(args)
    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.model)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model.eval()
    if device.type != "cuda":
        print(f"kvpop-warm-compile: on {device.type}, generate does not compile decode steps; nothing will be cached.",
              file=sys.stderr)
    records, bundle = warm(model, args.cache_dir, args.scorer, args.batches, sinks=args.sinks, window=args.window,
                           topk=args.topk, new_tokens=args.new_tokens, compile_mode=args.compile_mode,
                           fuse_projections=args.fuse_projections, prefill_chunk=args.prefill_chunk)
    for r in records:
        print(f"{r['scorer']} batch {r['batch']}: prefill {r['prefill_s']} s, generate {r['seconds']} s")
    print(f"compile cache {Path(args.cache_dir).resolve()}; bundle: {bundle or 'none (nothing was compiled)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
