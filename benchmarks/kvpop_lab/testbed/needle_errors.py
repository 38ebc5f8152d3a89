"""What a model's wrong needle answers are: each asked value of a keyed-needle family (``niah_multikey``,
``niah_multiquery``) in a kvpop-eval run, sorted by how it went wrong.

    python -m kvpop_lab.testbed.needle_errors RUN_DIR [--policy dense]

``RUN_DIR`` is a ``kvpop-eval`` output folder (``meta.json`` and ``outputs.jsonl``); every problem is regenerated from
its seed, length and knobs (``meta.json``) to know its needles. Kinds, per asked value (the prediction split at
``" , "``, each piece's last word: a restated key, ``restate_key=True``, is passed over):

* ``right``: the value.
* ``first_digit``: every digit right but the first (the model copied the right needle after a wrong start).
* ``other_needle``: the value of another needle in the text.
* ``other``: anything else (a missing value included).

``first_from_other`` counts the wrong values whose first digit is the first digit of another needle's value: a key-blind
copy of what follows another ``is :``. Prints one table per family and writes ``RUN_DIR/needle_errors.json``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from .tasks import make_problem

__all__ = ["KEYED_FAMILIES", "classify_value", "needle_errors", "main"]

KEYED_FAMILIES = ("niah_multikey", "niah_multiquery")
KINDS = ("right", "first_digit", "other_needle", "other")


def classify_value(answer: str, predicted: str, needles: list[str]) -> tuple[str, bool]:
    """``(kind, first_from_other)`` for one asked value: ``answer`` the right value, ``predicted`` the model's,
    ``needles`` the values of every needle in the text (``answer`` among them). ``first_from_other`` is True when the
    value is wrong and starts with the first digit of a needle other than ``answer``."""
    if predicted == answer:
        return "right", False
    others = [v for v in needles if v != answer]
    from_other = bool(predicted) and predicted[0] in {v[0] for v in others}
    if predicted in others:
        return "other_needle", from_other
    if len(predicted) == len(answer) and predicted[1:] == answer[1:]:
        return "first_digit", from_other
    return "other", from_other


def needle_errors(run_dir: str | Path, policy: str = "dense") -> dict[str, dict]:
    """Per keyed family of the run: ``{"values": n, kind: count for kind in KINDS, "first_from_other": count,
    "by_position": {i: Counter of kinds}}``, ``i`` the asked value's place in the answer (0 first)."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "meta.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "outputs.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["policy"] == policy and r["family"] in KEYED_FAMILIES]
    if not rows:
        raise ValueError(f"{run_dir}: no {'/'.join(KEYED_FAMILIES)} rows of policy {policy!r} in outputs.jsonl "
                         "(evaluate a keyed needle family, or name the run's policy with --policy)")
    by_position: dict[str, dict[int, Counter]] = {}
    from_other: Counter = Counter()
    for r in rows:
        fam = r["family"]
        problem = make_problem(fam, meta["length"], seed=r["seed"], **meta.get("knobs", {}).get(fam, {}))
        needles = list(problem.meta["needles"].values())
        predicted = [piece.rsplit(" ", 1)[-1] for piece in r["prediction"].split(" , ")]
        for i, answer in enumerate(problem.meta.get("query_values", [problem.answer])):
            kind, starts_other = classify_value(answer, predicted[i] if i < len(predicted) else "", needles)
            by_position.setdefault(fam, {}).setdefault(i, Counter())[kind] += 1
            from_other[fam] += starts_other
    out: dict[str, dict] = {}
    for fam, places in by_position.items():
        total = sum(places.values(), Counter())
        out[fam] = {"values": total.total(), **{k: total[k] for k in KINDS}, "first_from_other": from_other[fam],
                    "by_position": places}
    return out


def _table(fam: str, stats: dict) -> str:
    lines = [f"{fam}: {stats['values']} asked values",
             "| place | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for i, c in sorted(stats["by_position"].items()):
        lines.append(f"| {i + 1} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
    wrong = stats["values"] - stats["right"]
    lines.append(f"wrong values starting with another needle's first digit: {stats['first_from_other']} of {wrong}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a kvpop-eval output folder (meta.json, outputs.jsonl)")
    ap.add_argument("--policy", default="dense", help="the policy whose answers to read (default dense)")
    args = ap.parse_args(argv)
    result = needle_errors(args.run_dir, args.policy)
    for fam, stats in result.items():
        print(_table(fam, stats) + "\n")
    serial = {fam: {**s, "by_position": {str(i): dict(c) for i, c in s["by_position"].items()}}
              for fam, s in result.items()}
    (Path(args.run_dir) / "needle_errors.json").write_text(json.dumps(serial, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
