"""CLI: print or write testbed problems as JSONL.

    python -m kvpop_lab.testbed.generate --family reasoning --n 5 --length 2048 --seed 0
    python -m kvpop_lab.testbed.generate --family niah_multikey --knob value_kind=uuid --out x.jsonl
    python -m kvpop_lab.testbed.generate --family mix --n 100 --length 512:2048

Problem ``i`` uses seed ``seed + i`` (``--family mix`` uses :func:`mixture`
seeded with ``seed`` and draws lengths uniformly from ``LO:HI``). Each line
holds ``family``, ``prompt``, ``answer``, ``meta`` (``meta["trace"]`` is the
reference trace for ``reasoning``) and ``target`` (what the model should
generate after the prompt, before ``<eos>``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys

from .tasks import ALL_FAMILIES, FAMILIES, make_problem, mixture


def _parse_knob(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"--knob expects KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        val = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        val = v  # bare strings such as value_kind=uuid
    return k.strip(), val


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, choices=list(ALL_FAMILIES) + ["mix"])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--length", default="2048", help="tokens, or LO:HI for --family mix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--knob", action="append", type=_parse_knob, default=[],
                    help="generator knob KEY=VALUE (repeatable), e.g. hops=3")
    ap.add_argument("--out", default=None, help="write JSONL here instead of stdout")
    args = ap.parse_args(argv)
    knobs = dict(args.knob)
    try:
        if args.family == "mix":
            lo, _, hi = args.length.partition(":")
            rng = (int(lo), int(hi or lo))
            probs = mixture(FAMILIES, n=args.n, length_range=rng, seed=args.seed)
        else:
            length = int(args.length)
            probs = (make_problem(args.family, length=length, seed=args.seed + i, **knobs)
                     for i in range(args.n))
        out = open(args.out, "w") if args.out else sys.stdout
        try:
            for p in probs:
                rec = p.to_dict()
                rec["target"] = p.target
                out.write(json.dumps(rec) + "\n")
        finally:
            if args.out:
                out.close()
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
