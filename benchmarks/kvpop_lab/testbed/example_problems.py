"""The testbed problems that ``examples/generate.py`` runs, written as plain JSON so that the example needs only
the library: ``python -m kvpop_lab.testbed.example_problems`` rewrites ``examples/testbed_problems.json``
(``tests/test_example_generate.py`` checks that the file matches the generator)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .tasks import make_problem

#: the 4k testbed's reasoning problems (the generator's defaults differ)
KNOBS = {"n_facts": 10, "steps": 4}
LENGTHS = (1024, 4096)
SEED = 0
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "examples" / "testbed_problems.json"


def example_problems() -> dict:
    """``{str(length): {family, length, seed, knobs, prompt, answer}}`` for each of :data:`LENGTHS`."""
    out = {}
    for length in LENGTHS:
        p = make_problem("reasoning", length=length, seed=SEED, **KNOBS)
        out[str(length)] = {"family": "reasoning", "length": length, "seed": SEED, "knobs": KNOBS,
                            "prompt": p.prompt, "answer": p.answer}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    Path(args.out).write_text(json.dumps(example_problems(), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
