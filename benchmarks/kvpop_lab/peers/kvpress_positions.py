"""Which prompt positions a kvpress press keeps, read off the cache: after the prefill press and after ``--steps``
greedy decode steps, the positions of layer 0's kept entries for each KV head, in cache order. Runs in the kvpress
environment (no kvpop_hf). Layer 0's keys are a function of token and position only, so each kept key is matched
to the position of the dense prefill's key it equals (decoded tokens: positions >= the prompt length).

    PYTHONPATH=benchmarks /work/peers/kvpress-venv/bin/python -m kvpop_lab.peers.kvpress_positions \\
        --problems /work/peers/data/record_4k.jsonl --press streaming --mode decoding --steps 20
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpop_lab.peers.run_kvpress import PRESSES, build


def positions(kept, dense):
    """Position of each kept key ``[h, n, d]`` among the dense keys ``[h, T, d]`` (-1: not found)."""
    import torch

    out = []
    for h in range(kept.shape[0]):
        dist = torch.cdist(kept[h], dense[h], compute_mode="donot_use_mm_for_euclid_dist")  # [n, T]
        best = dist.min(-1)
        out.append(torch.where(best.values < 1e-4, best.indices, -1).tolist())
    return out


def summary(pos: list[int], prompt_len: int) -> str:
    sinks = sum(0 <= p < 4 for p in pos)
    missing = sum(p < 0 for p in pos)
    decoded = sum(p >= prompt_len for p in pos)
    ordered = all(a < b for a, b in zip(pos, pos[1:]))
    return (f"{len(pos)} entries ({missing} unmatched): sinks {sinks}/4, decoded tokens {decoded}, in position order {ordered}, "
            f"first in cache order {pos[:6]}, oldest non-sink {min((p for p in pos if p >= 4), default=None)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", required=True)
    ap.add_argument("--model", default="checkpoints/testbed-4k-teacher")
    ap.add_argument("--press", default="streaming", choices=[p for p in PRESSES if p != "dense"])
    ap.add_argument("--mode", default="decoding", choices=["prefill", "decoding"])
    ap.add_argument("--compression", default="0.88")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    row = json.loads(Path(args.problems).read_text().splitlines()[0])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    budget = row["budgets"][args.compression]
    ids = torch.tensor([row["prompt_ids"]])
    L = ids.shape[1]
    with torch.no_grad():
        dense = DynamicCache()
        out = model.generate(ids, max_new_tokens=args.steps + 1, do_sample=False, past_key_values=dense,
                             eos_token_id=row["eos_token_id"], pad_token_id=row["pad_token_id"], min_new_tokens=args.steps + 1)
        dense_keys = dense.layers[0].keys[0]
        for steps in (0, args.steps):
            cache = DynamicCache()
            press = build(args.press, args.mode, L, budget)
            with press(model):
                model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                               past_key_values=cache, eos_token_id=row["eos_token_id"], pad_token_id=row["pad_token_id"])
            kept = cache.layers[0].keys[0]
            for h, pos in enumerate(positions(kept, dense_keys)):
                print(f"{args.press} {args.mode} B={budget} after prefill + {steps} steps, head {h}: {summary(pos, L)}")
    del out
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
