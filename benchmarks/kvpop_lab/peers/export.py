"""Write the table of record's problems to JSONL for the peer libraries' runners (which import nothing of
kvpop_hf): ``index``, ``seed``, ``family``, ``prompt_ids`` (``<bos>`` prompt), ``answer``, ``target``,
``max_new_tokens``, ``eos_token_id``, ``pad_token_id`` and ``budgets`` (``{"0.88": 492, "0.94": 246}``).

    python -m kvpop_lab.peers.export --out /work/peers/data/record_4k.jsonl [--n 80]
"""

from __future__ import annotations

import argparse

from kvpop_lab.peers.problems import RECORD, problem_record, record_problems, write_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--n", type=int, default=RECORD["n"], help="first n problems of the record (default 80)")
    ap.add_argument("--tokenizer", default="checkpoints/testbed-4k-teacher", help="the teacher's tokenizer folder")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    problems = record_problems(args.n)  # a bad --n fails before the tokenizer loads
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = (problem_record(i, RECORD["seed_base"] + i, p, tok) for i, p in enumerate(problems))
    n = write_jsonl(args.out, rows)
    print(f"wrote {n} problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
