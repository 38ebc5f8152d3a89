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

__all__ = ["niah_multivalue", "niah_multiquery", "RULER_FAMILIES", "check_flag", "key_link", "restated"]


def _distinct_numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = _number(rng, digits)
        if v not in out:
            out.append(v)
    return out


def check_flag(fam: str, name: str, value: object) -> None:
    """A knob that must be True or False (``1`` or ``"yes"`` is refused rather than read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{fam}: {name} must be True or False, got {value!r}")


def key_link(adjacent_key: bool) -> str:
    """The words between a needle's key and its value: ``is :``, or ``:`` alone with ``adjacent_key`` (the token
    before the value is then the key's last word)."""
    return ":" if adjacent_key else "is :"


def _keyed_needles(fam: str, rng: random.Random, num_needles: int, num_queries: int, value_digits: int,
                   adjacent_key: bool = False) -> tuple[list[str], list[str], list[tuple[str, int]]]:
    """Checks the knobs of a family that asks ``num_queries`` of ``num_needles`` two-word keys, then draws the keys,
    their distinct values and the needle lines ``(line, index)``."""
    for name, value in (("num_needles", num_needles), ("num_queries", num_queries), ("value_digits", value_digits)):
        _check_positive_int(fam, name, value)
    check_flag(fam, "adjacent_key", adjacent_key)
    if num_queries > num_needles:
        raise ValueError(f"{fam}: num_queries={num_queries} must be <= num_needles={num_needles}")
    if 2 * num_needles > len(ENTITY_WORDS):
        raise ValueError(f"{fam}: num_needles must be <= {len(ENTITY_WORDS) // 2}")
    kw = rng.sample(ENTITY_WORDS, 2 * num_needles)
    keys = [f"{kw[2 * i]} {kw[2 * i + 1]}" for i in range(num_needles)]
    values = _distinct_numbers(rng, num_needles, value_digits)
    link = key_link(adjacent_key)
    needles = [(f"one of the special magic numbers for {k} {link} {v} .", i)
               for i, (k, v) in enumerate(zip(keys, values))]
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


def restated(key: str, link: str, noun: str = "number") -> str:
    """A needle's words up to its value, as an answer restates them: ``the special magic <noun> for <key> <link>``."""
    return f"the special magic {noun} for {key} {link}"


def niah_multiquery(seed: int | random.Random = 0, length: int = 1024, num_needles: int = 4, num_queries: int = 2,
                    value_digits: int = 7, restate_key: bool = False, adjacent_key: bool = False) -> Problem:
    """``num_needles`` keys with one value each; ``num_queries`` of them are asked in one question and the answer
    lists their values in the question's order (``"v1 , v2"``).

    The layout knobs of :func:`~kvpop_lab.testbed.tasks.niah_multikey`: ``adjacent_key=True`` drops ``is`` between
    key and value in the needles; ``restate_key=True`` puts each asked key before its value in the needle's words, the
    first in the prompt's answer prefix (``answer : the special magic number for <k1> is :``) and the others in the
    answer (``"v1 , the special magic number for <k2> is : v2"``). Same draw with or without them.
    ``meta["query_values"]`` lists the asked values in order."""
    fam = "niah_multiquery"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    check_flag(fam, "restate_key", restate_key)
    keys, values, needles = _keyed_needles(fam, rng, num_needles, num_queries, value_digits, adjacent_key)
    asked = rng.sample(range(num_needles), num_queries)
    names = [keys[i] for i in asked]
    link = key_link(adjacent_key)
    marker = f"{ANSWER_MARKER} {restated(names[0], link)}" if restate_key else ANSWER_MARKER
    parts = [values[i] if (j == 0 or not restate_key) else f"{restated(keys[i], link)} {values[i]}"
             for j, i in enumerate(asked)]
    return _build(fam, length, rng, needles, [multiquery_question(names), marker], " , ".join(parts),
                  {"num_needles": num_needles, "num_queries": num_queries, "value_digits": value_digits,
                   "restate_key": restate_key, "adjacent_key": adjacent_key}, False,
                  {"needles": dict(zip(keys, values)), "query_keys": names,
                   "query_values": [values[i] for i in asked]})


RULER_FAMILIES = {"niah_multivalue": niah_multivalue, "niah_multiquery": niah_multiquery}
