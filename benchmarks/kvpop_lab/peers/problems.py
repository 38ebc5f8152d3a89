"""The table of record's problems, budgets and exact match for the peers benchmark: the one module here that
imports the testbed (``kvpop_lab.testbed``), so a move of the testbed changes one import line.

The table of record (``results/quality_4k_record.csv``; ``checkpoints/testbed-4k-kvpop-cr88/README.md``) draws
``reasoning`` problems of 4096 tokens with ``n_facts=10, steps=4``, problem ``i`` with seed ``2**48 + 5000 + i``,
``i < 80``, and evaluates them with ``kvpop-eval`` (greedy, float32, ``max_new_tokens`` = the reference target's
tokens + ``<eos>`` + 8, exact match of :func:`extract_answer` against :func:`normalize` of the answer).
Budgets: compression ``c`` at ``L = 4096`` tokens is ``B = round((1 - c) * L)`` entries per layer and KV head
(``kvpop_hf.policies.parse_budgets``): 492 at 88%, 246 at 94%; 4 sinks, a 64-token window, ``B - 68``
long-range slots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from kvpop_lab.testbed import count_tokens, extract_answer, make_problem, normalize
from kvpop_lab.testbed.dense_eval import exact_match
from kvpop_lab.testbed.models import load_model
from kvpop_hf.policies import POLICIES, bind_factory, parse_budgets
from kvpop_lab.testbed.tasks import Problem

__all__ = ["RECORD", "record_problems", "budget", "max_new_tokens", "problem_record", "write_jsonl", "read_jsonl",
           "score_ids", "prefix_share", "exact_match", "load_model", "POLICIES", "bind_factory", "Problem"]

# the table of record's draw (results/quality_4k_record.csv, benchmarks/gpu/testbed_4k.sh SEED_BASE/EVAL_N)
RECORD = {"family": "reasoning", "length": 4096, "seed_base": 2 ** 48 + 5000, "n": 80,
          "knobs": {"n_facts": 10, "steps": 4}, "sinks": 4, "window": 64, "compressions": (0.88, 0.94)}


def record_problems(n: int = RECORD["n"], seed_base: int = RECORD["seed_base"]) -> list[Problem]:
    """The first ``n`` problems of the table of record (seeds ``seed_base + i``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    return [make_problem(RECORD["family"], length=RECORD["length"], seed=seed_base + i, **RECORD["knobs"])
            for i in range(n)]


def budget(compression: float, length: int = RECORD["length"], window: int = RECORD["window"]) -> dict[str, int]:
    """``{"B", "sinks", "window", "topk"}`` of compression ``c`` as kvpop-eval spends it:
    ``B = round((1 - c) * length)`` entries per layer and KV head, ``topk = B - sinks - window``."""
    b = parse_budgets(compression=[repr(float(compression))], length=length, sinks=RECORD["sinks"], window=window)[0]
    return {"B": b.B, "sinks": b.sinks, "window": b.window, "topk": b.topk}


def max_new_tokens(problem: Problem, margin: int = 8) -> int:
    """kvpop-eval's generation length for one problem alone: reference target tokens + ``<eos>`` + ``margin``
    (``kvpop_lab.testbed.dense_eval``; a batch takes its longest problem's)."""
    return count_tokens(problem.target) + 1 + margin


def problem_record(index: int, seed: int, problem: Problem, tokenizer: Any) -> dict:
    """One JSONL line: the prompt's token ids (``<bos>`` prompt, as kvpop-eval encodes it), the normalised
    answer, the generation length, and the budget ``B`` of each compression of the record."""
    return {"index": index, "seed": seed, "family": problem.family, "length": RECORD["length"],
            "prompt_ids": tokenizer(problem.prompt)["input_ids"], "answer": normalize(problem.answer),
            "target": problem.target, "max_new_tokens": max_new_tokens(problem),
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "budgets": {f"{c:.2f}": budget(c)["B"] for c in RECORD["compressions"]}}


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write one JSON object a line; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSONL file (blank lines skipped); a missing file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: write it first (python -m kvpop_lab.peers.export --out {path}).")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def score_ids(tokenizer: Any, generated_ids: list[int], answer: str) -> dict:
    """Exact match of generated token ids as ``kvpop_lab.testbed.dense_eval.exact_match`` scores a row: cut at the
    first ``<eos>``, decode with special tokens, :func:`extract_answer`, compare with the normalised answer."""
    toks = list(generated_ids)
    eos = tokenizer.eos_token_id
    if eos in toks:
        toks = toks[:toks.index(eos)]
    text = tokenizer.decode(toks, skip_special_tokens=False)
    pred = extract_answer(text)
    gold = normalize(answer)
    return {"prediction": pred, "answer": gold, "correct": pred == gold, "generated": normalize(text)}


def prefix_share(generated: str, target: str) -> float:
    """The share of the reference target's words (``normalize``-d, whitespace-split) that ``generated`` reproduces
    before its first wrong word: where a trace goes astray, a finer signal than the final answer."""
    gen, ref = normalize(generated).split(), normalize(target).split()
    if not ref:
        raise ValueError("empty reference target")
    n = 0
    while n < min(len(gen), len(ref)) and gen[n] == ref[n]:
        n += 1
    return n / len(ref)
