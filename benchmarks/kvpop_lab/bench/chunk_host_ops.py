"""Host-side cost of one prompt chunk: torch operator calls per layer, by scorer and chunk length.

On a GPU a prefill chunk of a large model is partly bound by the host launching operators (the per-layer
scorer and selection work); the count of ``aten::`` calls for one chunk of a one-layer model is a
device-independent measure of it (run on CPU).

    python benchmarks/chunk_host_ops.py --scorers knorm mlp mlstm --lengths 4096 16384 \
        --out results/chunk_host_ops_cpu.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvpop_hf import KVpopCache
from kvpop_hf.cli.budget_flags import add_budget_flags
from kvpop_hf.compat import with_cache
from kvpop_lab.utils.provenance import git_commit, versions

REPO = Path(__file__).resolve().parents[3]


def aten_calls(scorer: str, length: int, budget: tuple[int, int, int]) -> int:
    """``aten::`` calls of the second of two ``length``-token chunks through a one-layer Qwen3."""
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * length,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.set_attn_implementation("kvpop")
    s, w, k = budget
    cache = KVpopCache(model.config, sinks=s, window=w, topk=k, scorer=scorer)
    ids = torch.randint(1, 256, (1, 2 * length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :length], **with_cache(model, cache))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids[:, length:], **with_cache(model, cache))
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scorers", nargs="+", default=["knorm", "mlp", "mlstm"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    add_budget_flags(ap, sinks=4, window=64, topk=188)
    ap.add_argument("--out", default=None, help="markdown file for the table")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.lengths):
        raise ValueError(f"--lengths must be >= 1, got {args.lengths}.")
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) \
        if argv is None else f"main({argv!r})"
    budget = (args.sinks, args.window, args.topk)
    rows = [(sc, n, aten_calls(sc, n, budget)) for sc in args.scorers for n in args.lengths]
    lines = ["| scorer | chunk tokens | aten calls (one layer) |", "|---|---|---|"]
    lines += [f"| {sc} | {n} | {c} |" for sc, n, c in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        env = ", ".join(f"{k} {v}" for k, v in versions("torch", "transformers").items())
        Path(args.out).write_text(
            f"# Operator calls of one prompt chunk\n\nCommand: `{command}`\n\n- commit `{git_commit(REPO)}`, "
            f"{_dt.datetime.now().astimezone().isoformat(timespec='seconds')}; {env}\n- one-layer Qwen3 (CPU), "
            f"B = {'+'.join(map(str, budget))}, the second of two chunks of that length\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
