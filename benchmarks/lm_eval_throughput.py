"""lm-eval ``generate_until`` throughput and peak memory: ``--model kvpop`` against ``--model hf``, one process.

    # one H200: Qwen3-8B shapes, random bf16 weights, 16 prompts of 16384 tokens in one batch, 256 new tokens
    python benchmarks/lm_eval_throughput.py --device cuda --shape qwen3-8b --batch 16 --context 16384 \\
        --new-tokens 256 --out "$OUT/lm_eval_throughput"
    # CPU smoke run
    python benchmarks/lm_eval_throughput.py --device cpu --shape tiny --batch 2 --context 256 --new-tokens 8 --out /tmp/x

Both runs go through lm-eval's own ``HFLM.generate_until`` (request batching, left padding, stop criteria,
``model.generate``) on the same model object and the same requests, greedy (``--batching static``, the default
here, which the recorded rows measured; ``--batching continuous``, ``--model kvpop``'s own default, serves the kvpop
runs through ``kvpop_hf.generate_batch`` with ``--batch`` rows instead); ``kvpop`` adds a fresh cache per batch
(``--policies``, default ``kvpop`` with a random-init mLSTM scorer checkpoint, the speed does not depend on its
values, and ``knorm``; budget ``--compression`` of each prompt, sinks 4, window 64). The prompts are
``--context`` words of a word-level tokenizer built here over the model's whole vocabulary (one word = one token,
no download). Per run: seconds for the batch (after ``--warmup`` untimed batches of the same size with 512-token prompts), new tokens
per second (``batch x new tokens`` / seconds; rows that meet the tokenizer's eos early still take every step),
``torch.cuda.max_memory_allocated`` above the weights, and the first row's text (a check that both decode).
Writes ``result.json`` and ``result.md`` (command, commit, date, versions) under ``--out``.

lm-eval missing (the GPU machine has torch, transformers, accelerate, jinja2, pyyaml and requests, not lm-eval):
benchmarks/gpu/lm_eval_throughput.sh installs its pure-Python wheel offline, without dependencies, into a folder on
``PYTHONPATH`` (``pip download --no-deps -d .whl/lm_eval lm-eval==0.4.13`` here, about 9 MB; carry ``.whl``); the
model path imports lm_eval itself and nothing else beyond those.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path


SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, head_dim, vocab
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936),
    "tiny": (128, 256, 2, 4, 2, 32, 512),
}


def ensure_lm_eval() -> None:
    """lm-eval importable, else a SystemExit naming how to bring it (before any work)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SystemExit("lm-eval is not installed: pip install -e '.[lm-eval]'; on a machine without a package "
                         "registry install its wheel offline (benchmarks/gpu/lm_eval_throughput.sh shows how).") from None


def word_tokenizer(vocab: int):
    """One token per whitespace-separated word ``w<i>``; ids 0/1/2 are pad/eos/bos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(3, vocab)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   padding_side="left")


def build_model(shape: str, device, dtype, max_pos: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, inter, layers, heads, kv_heads, head_dim, vocab = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--policies", default="kvpop,knorm", help="kvpop model policies to time beside --model hf")
    ap.add_argument("--compression", type=float, default=0.88)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="kvpop prefill_chunk= (default: one forward)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true",
                    help="pass disable_compile=True to model.generate (no automatic compile of the decode step)")
    ap.add_argument("--batching", default="static", choices=["static", "continuous"],
                    help="kvpop batching=: static (lm-eval's batches through model.generate, the recorded rows) or "
                         "continuous (generate_batch with --batch rows)")
    ap.add_argument("--stack-every", type=float, default=0,
                    help="seconds: print every thread's stack this often to stderr (0: never), to see where time goes")
    ap.add_argument("--out", required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    ensure_lm_eval()
    import faulthandler

    faulthandler.enable()  # a crash in compiled code prints the Python stack
    if args.stack_every:
        faulthandler.dump_traceback_later(args.stack_every, repeat=True)

    import tempfile

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from kvpop_hf import KVpopCache, UntrainedScorerWarning
    from kvpop_hf.integrations.lm_eval import KVpopLM
    from kvpop_lab.utils.provenance import git_commit, versions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    model = build_model(args.shape, device, dtype, args.context + args.new_tokens + 64)
    tok = word_tokenizer(model.config.vocab_size)
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{i}" for i in torch.randint(3, model.config.vocab_size, (args.context,), generator=g)
                        .tolist()) for _ in range(args.batch)]  # one token per word, no <bos> added
    gen = {"until": [], "max_gen_toks": args.new_tokens, "do_sample": False,
           **({"disable_compile": True} if args.no_compile else {})}

    def requests(ps, new_tokens=args.new_tokens):
        return [Instance("generate_until", {}, (p, {**gen, "max_gen_toks": new_tokens}), i) for i, p in enumerate(ps)]

    ckpt = tempfile.mkdtemp()
    with warnings.catch_warnings():  # a random-weight mlstm checkpoint on purpose: the speed does not depend on them
        warnings.simplefilter("ignore", UntrainedScorerWarning)
        KVpopCache(model.config, sinks=4, window=64, topk=64, scorer="mlstm",
                   scorer_kwargs={"delayed": True}).save_pretrained(ckpt)
    runs = [(f"kvpop:{p}", {"policy": p, "sinks": 4, "window": 64, "compression": args.compression,
                                           **({"scorer": ckpt} if p == "kvpop" else {}),
                                           **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}),
                                           "compile": not args.no_compile, "batching": args.batching})
                           for p in args.policies.split(",") if p] + [("hf", {})]
    meta = {"command": "python benchmarks/lm_eval_throughput.py " + shlex.join(argv), "commit": git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "versions": versions("torch", "transformers", "lm_eval", "kvpop_hf", missing=None),
            "shape": args.shape, "dtype": args.dtype, "batch": args.batch, "context": args.context,
            "new_tokens": args.new_tokens, "weights_gib": round(weights / 2 ** 30, 3), "rows": []}
    rows = meta["rows"]
    for name, margs in runs:
        if name == "hf":
            lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch, max_length=model.config.max_position_embeddings)
        else:
            lm = KVpopLM(pretrained=model, tokenizer=tok, batch_size=args.batch,
                         max_length=model.config.max_position_embeddings, **margs)
        model.set_attn_implementation("sdpa" if name == "hf" else "kvpop")
        t_warm = time.perf_counter()
        for _ in range(args.warmup):  # the timed batch itself, 8 new tokens: compiles what the timed run reuses
            lm.generate_until(requests(prompts, min(8, args.new_tokens)), disable_tqdm=True)
        print(f"{name}: warmup {time.perf_counter() - t_warm:.1f} s", flush=True)
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        texts = lm.generate_until(requests(prompts), disable_tqdm=True)
        if cuda:
            torch.cuda.synchronize(device)
        secs = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(device) - weights) if cuda else float("nan")
        row = {"run": name, "compile": not args.no_compile and name != "hf",
               "model_args": {k: v for k, v in margs.items() if k != "scorer"}, "seconds": round(secs, 3),
               "new_tokens_per_s": round(args.batch * args.new_tokens / secs, 2),
               "peak_mem_above_weights_gib": round(peak / 2 ** 30, 3),
               "new_words_per_row": [len(t.split()) for t in texts], "first_row_text_head": texts[0][:80]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "result.json").write_text(json.dumps(meta, indent=2) + "\n")  # each row as it finishes
        del lm
    (out / "result.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = [f"# lm-eval generate_until: --model kvpop vs --model hf ({meta['device']})", "",
             f"`{meta['command']}` (commit {meta['commit']}, {meta['date']})", "",
             f"{args.shape} random {args.dtype} weights, batch {args.batch} x {args.context} prompt tokens, "
             f"{args.new_tokens} new tokens, greedy.", "",
             "| run | seconds | new tokens/s | peak memory above weights (GiB) |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['seconds']} | {r['new_tokens_per_s']} | {r['peak_mem_above_weights_gib']} |"
              for r in rows]
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
