"""Needle drill (a training family, not one of the evaluated families): the key-to-value binding of
:func:`~kvpop_lab.testbed.tasks.niah_multikey`, asked several times per problem.

The body is a multi-key haystack (``num_needles`` lines ``one of the special magic numbers for <k1> <k2> is : <v> .``
among filler). The prompt ends with the multi-key question about one needle and ``answer :``, exactly as in
``niah_multikey``; the target answers it, then asks and answers ``num_queries - 1`` further needles in the same
words::

    answer : 4960783
    question : what is the special magic number for faro patal mentioned in the text ?
    answer : 2043885

Only the values are supervised (``meta["target_segments"]``, read by
:func:`~kvpop_lab.testbed.tasks.training_example`): a follow-up question names a needle the model cannot predict,
so its words carry no loss. A ``niah_multikey`` problem supervises one binding decision, the first digit of its
value (the other digits are copied once the needle is found); a drill problem supervises ``num_queries`` of them
at the same place in the same sentence.
"""

from __future__ import annotations

import random

from .problem import (Problem, _as_rng, _check_length, _check_positive_int, _cost, _filler_lines, _finish, _fixed_cost,
                    _interleave, _too_small)
from .ruler_tasks import _distinct_numbers
from .tokenizer import ANSWER_MARKER
from .vocab import ENTITY_WORDS

__all__ = ["needle_drill"]


def _question(key: str) -> str:
    return f"question : what is the special magic number for {key} mentioned in the text ?"


def needle_drill(seed: int | random.Random = 0, length: int = 1024, num_needles: int = 6, num_queries: int = 3,
                 value_digits: int = 7) -> Problem:
    """``num_needles`` keyed needles; ``num_queries`` distinct ones are asked one after the other, the first in the
    prompt and the rest in the target. ``answer`` is the target without its leading space; ``meta`` holds the
    needles, the asked keys in order and ``target_segments`` (``[text, supervised]`` pairs whose texts join to
    ``problem.target``)."""
    fam = "needle_drill"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    for name, value in (("num_needles", num_needles), ("num_queries", num_queries), ("value_digits", value_digits)):
        _check_positive_int(fam, name, value)
    if num_queries > num_needles:
        raise ValueError(f"{fam}: num_queries={num_queries} must be <= num_needles={num_needles}")
    if 2 * num_needles > len(ENTITY_WORDS):
        raise ValueError(f"{fam}: num_needles must be <= {len(ENTITY_WORDS) // 2}")
    kw = rng.sample(ENTITY_WORDS, 2 * num_needles)
    keys = [f"{kw[2 * i]} {kw[2 * i + 1]}" for i in range(num_needles)]
    values = _distinct_numbers(rng, num_needles, value_digits)
    asked = rng.sample(range(num_needles), num_queries)
    segments: list[list] = [[" " + values[asked[0]], True]]
    for i in asked[1:]:
        segments += [["\n" + _question(keys[i]) + "\n" + ANSWER_MARKER, False], [" " + values[i], True]]
    target = "".join(text for text, _ in segments)
    head = ["some special magic numbers are hidden in the text below . memorize them ."]
    tail = [_question(keys[asked[0]]), ANSWER_MARKER]
    needles = [(f"one of the special magic numbers for {k} is : {v} .", i)
               for i, (k, v) in enumerate(zip(keys, values))]
    body_budget = length - _fixed_cost(head, tail, target)
    need = _cost(line for line, _ in needles)
    if body_budget < need:
        raise _too_small(fam, length, length - body_budget + need,
                         f"num_needles={num_needles}, num_queries={num_queries}, value_digits={value_digits}")
    body = _interleave(rng, _filler_lines(rng, body_budget - need), [[n] for n in needles])
    prompt, n_tokens, pos = _finish(fam, head, body, tail, target)
    meta = {"needles": dict(zip(keys, values)), "query_keys": [keys[i] for i in asked],
            "needle_token_pos": [pos[i] for i in range(num_needles)], "n_tokens": n_tokens,
            "target_segments": segments,
            "knobs": {"length": length, "num_needles": num_needles, "num_queries": num_queries,
                      "value_digits": value_digits}}
    return Problem(fam, prompt, target[1:], meta)
