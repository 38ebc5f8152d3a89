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

from .problem import Problem, _as_rng, _check_length
from .ruler_tasks import _build, _keyed_needles
from .tokenizer import ANSWER_MARKER

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
    keys, values, needles = _keyed_needles(fam, rng, num_needles, num_queries, value_digits)
    asked = rng.sample(range(num_needles), num_queries)
    segments: list[list] = [[" " + values[asked[0]], True]]
    for i in asked[1:]:
        segments += [["\n" + _question(keys[i]) + "\n" + ANSWER_MARKER, False], [" " + values[i], True]]
    answer = "".join(text for text, _ in segments)[1:]  # the target is " " + answer, as in every needle family
    return _build(fam, length, rng, needles, [_question(keys[asked[0]]), ANSWER_MARKER], answer,
                  {"num_needles": num_needles, "num_queries": num_queries, "value_digits": value_digits}, False,
                  {"needles": dict(zip(keys, values)), "query_keys": [keys[i] for i in asked],
                   "target_segments": segments})
