"""RULER-style needle tasks beyond :func:`~kvpop_lab.testbed.tasks.niah_multikey`: several values for one key
(multi-value) and several keys asked at once (multi-query). Same text conventions, length convention and seeding as
:mod:`kvpop_lab.testbed.tasks`; the answer lists the values (in order of appearance, or in the question's order)
joined by ``" , "``, scored by exact match like every testbed family.
"""

from __future__ import annotations

import random

from .problem import (Problem, _as_rng, _check_length, _check_positive_int, _cost, _filler_lines, _finish, _fixed_cost,
                    _interleave, _number, _too_small)
from .tokenizer import ANSWER_MARKER
from .vocab import ENTITY_WORDS

__all__ = ["niah_multivalue", "niah_multiquery", "RULER_FAMILIES"]


def _distinct_numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = _number(rng, digits)
        if v not in out:
            out.append(v)
    return out


def _keyed_needles(fam: str, rng: random.Random, num_needles: int, num_queries: int,
                   value_digits: int) -> tuple[list[str], list[str], list[tuple[str, int]]]:
    """Checks the knobs of a family that asks ``num_queries`` of ``num_needles`` two-word keys, then draws the keys,
    their distinct values and the needle lines ``(line, index)``."""
    for name, value in (("num_needles", num_needles), ("num_queries", num_queries), ("value_digits", value_digits)):
        _check_positive_int(fam, name, value)
    if num_queries > num_needles:
        raise ValueError(f"{fam}: num_queries={num_queries} must be <= num_needles={num_needles}")
    if 2 * num_needles > len(ENTITY_WORDS):
        raise ValueError(f"{fam}: num_needles must be <= {len(ENTITY_WORDS) // 2}")
    kw = rng.sample(ENTITY_WORDS, 2 * num_needles)
    keys = [f"{kw[2 * i]} {kw[2 * i + 1]}" for i in range(num_needles)]
    values = _distinct_numbers(rng, num_needles, value_digits)
    needles = [(f"one of the special magic numbers for {k} is : {v} .", i) for i, (k, v) in enumerate(zip(keys, values))]
    return keys, values, needles


def _build(fam: str, length: int, rng: random.Random, needles: list[tuple[str, int]], tail: list[str], answer: str,
           knobs: dict, ordered: bool, meta: dict) -> Problem:
    head = ["some special magic numbers are hidden in the text below . memorize them ."]
    target = " " + answer
    body_budget = length - _fixed_cost(head, tail, target)
    need = _cost(line for line, _ in needles)
    if body_budget < need:
        raise _too_small(fam, length, length - body_budget + need, ", ".join(f"{k}={v}" for k, v in knobs.items()))
    groups = [needles] if ordered else [[n] for n in needles]  # one group keeps the needles in order
    body = _interleave(rng, _filler_lines(rng, body_budget - need), groups)
    prompt, n_tokens, pos = _finish(fam, head, body, tail, target)
    meta.update(needle_token_pos=[pos[i] for i in range(len(needles))], n_tokens=n_tokens,
                knobs={"length": length, **knobs})
    return Problem(fam, prompt, answer, meta)


def niah_multivalue(seed: int | random.Random = 0, length: int = 1024, num_values: int = 4,
                    value_digits: int = 7) -> Problem:
    """One key with ``num_values`` values, each on its own needle line among filler; the answer is every value
    in order of appearance (``"v1 , v2 , ..."``)."""
    fam = "niah_multivalue"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    _check_positive_int(fam, "num_values", num_values)
    _check_positive_int(fam, "value_digits", value_digits)
    a, b = rng.sample(ENTITY_WORDS, 2)
    key = f"{a} {b}"
    values = _distinct_numbers(rng, num_values, value_digits)
    needles = [(f"one of the special magic numbers for {key} is : {v} .", i) for i, v in enumerate(values)]
    tail = [f"question : what are all the special magic numbers for {key} mentioned in the text ?", ANSWER_MARKER]
    return _build(fam, length, rng, needles, tail, " , ".join(values),
                  {"num_values": num_values, "value_digits": value_digits}, True, {"key": key, "values": values})


def multikey_question(key: str, noun: str = "number") -> str:
    """The niah_multikey question asking the value (a ``noun``) of the key ``key``."""
    return f"question : what is the special magic {noun} for {key} mentioned in the text ?"


def multiquery_question(names: list[str]) -> str:
    """The niah_multiquery question asking the values of the keys ``names`` (answered in this order)."""
    listed = names[0] if len(names) == 1 else " , ".join(names[:-1]) + " and " + names[-1]
    return f"question : what are the special magic numbers for {listed} mentioned in the text ?"


def niah_multiquery(seed: int | random.Random = 0, length: int = 1024, num_needles: int = 4, num_queries: int = 2,
                    value_digits: int = 7) -> Problem:
    """``num_needles`` keys with one value each; ``num_queries`` of them are asked in one question and the answer
    lists their values in the question's order (``"v1 , v2"``)."""
    fam = "niah_multiquery"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    keys, values, needles = _keyed_needles(fam, rng, num_needles, num_queries, value_digits)
    asked = rng.sample(range(num_needles), num_queries)
    names = [keys[i] for i in asked]
    tail = [multiquery_question(names), ANSWER_MARKER]
    return _build(fam, length, rng, needles, tail, " , ".join(values[i] for i in asked),
                  {"num_needles": num_needles, "num_queries": num_queries, "value_digits": value_digits}, False,
                  {"needles": dict(zip(keys, values)), "query_keys": names})


RULER_FAMILIES = {"niah_multivalue": niah_multivalue, "niah_multiquery": niah_multiquery}
