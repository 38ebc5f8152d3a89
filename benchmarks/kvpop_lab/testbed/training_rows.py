"""The testbed as a generated training source: ``--dataset testbed:FAMILY[,FAMILY...]`` of ``kvpop-retrofit`` and
``kvpop-train-dms`` (installed under the entry-point group ``kvpop_hf.generated_data``, see
``kvpop_hf/data/generated.py``)."""

from __future__ import annotations

import random

import torch

from .evaluate import parse_knobs
from .tasks import ALL_FAMILIES, make_problem, training_example


def testbed_examples(families, tokenizer, seq_len, n, seed, knobs=None) -> list[dict]:
    """``n`` teacher-forced examples of exactly ``seq_len`` tokens (``input_ids``, ``labels``: ``LongTensor[seq_len]``),
    the families taken in turn; ``knobs``: ``{family: {knob: value}}``. A problem the generator made shorter than
    ``seq_len`` is skipped, not padded."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        family = families[len(out) % len(families)]
        problem = make_problem(family, length=seq_len, seed=rng.randrange(1 << 30), **(knobs or {}).get(family, {}))
        ex = training_example(problem, tokenizer, mode="trace")
        ids, labels = ex["input_ids"], ex["labels"]
        if len(ids) < seq_len:
            continue
        out.append({"input_ids": torch.tensor(ids[:seq_len]), "labels": torch.tensor(labels[:seq_len])})
    return out


def check_testbed_spec(spec: str, knobs=()) -> tuple[list[str], dict]:
    """``spec`` (comma-separated families) and the ``FAMILY.KEY=VALUE`` knobs, checked: (families, parsed knobs)."""
    families = [f for f in spec.split(",") if f]
    unknown = sorted(set(families) - set(ALL_FAMILIES))
    if not families or unknown:
        raise ValueError(f"--dataset testbed:{spec} names no family or unknown ones {unknown}; the families are "
                         f"{', '.join(ALL_FAMILIES)}.")
    return families, parse_knobs(list(knobs), families)


def testbed_rows(spec: str, tokenizer, seq_len: int, n: int, seed: int, knobs=()) -> list[dict]:
    """The entry point: ``spec`` is the comma-separated families, ``knobs`` the ``FAMILY.KEY=VALUE`` strings."""
    families, parsed = check_testbed_spec(spec, knobs)
    return testbed_examples(families, tokenizer, seq_len, n, seed, parsed)


testbed_rows.check = check_testbed_spec  # called by the training commands before they load anything
