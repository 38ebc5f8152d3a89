"""Needle drill (a training family, not one of the evaluated families): the key-to-value binding of
:func:`~kvpop_lab.testbed.tasks.niah_multikey` and :func:`~kvpop_lab.testbed.ruler_tasks.niah_multiquery`, asked
several times per problem.

The body is a multi-key haystack (``num_needles`` lines ``one of the special magic numbers for <k1> <k2> is : <v> .``
among filler). Each of ``num_queries`` questions asks between 1 and ``max_keys`` needles not asked before: one key
in niah_multikey's words, several in niah_multiquery's (the values listed in the question's order). The prompt ends
with the first question and ``answer :``, as the evaluated family of its kind does; the target answers it, then asks
and answers the others::

    answer : 4960783
    question : what are the special magic numbers for faro patal and kemo brega mentioned in the text ?
    answer : 2043885 , 7710342

Only the answers are supervised (``meta["target_segments"]``, read by
:func:`~kvpop_lab.testbed.tasks.training_example`): a follow-up question names needles the model cannot predict, so
its words carry no loss. A ``niah_multikey`` problem supervises one binding decision, the first digit of its value
(the other digits are copied once the needle is found); a drill problem supervises one per asked key, in the
sentences of the evaluated families.
"""

from __future__ import annotations

import random

from .problem import Problem, _as_rng, _check_length, _check_positive_int
from .ruler_tasks import _build, _keyed_needles, multikey_question, multiquery_question
from .tokenizer import ANSWER_MARKER

__all__ = ["needle_drill"]


def _question(keys: list[str]) -> str:
    return multikey_question(keys[0]) if len(keys) == 1 else multiquery_question(keys)


def needle_drill(seed: int | random.Random = 0, length: int = 1024, num_needles: int = 6, num_queries: int = 3,
                 value_digits: int = 7, max_keys: int = 2) -> Problem:
    """``num_needles`` keyed needles; ``num_queries`` questions, each about 1 to ``max_keys`` (uniform) needles not
    asked before, the first in the prompt and the rest in the target. ``answer`` is the target without its leading
    space; ``meta`` holds the needles, the asked keys in order (``query_keys``, and per question ``question_keys``)
    and ``target_segments`` (``[text, supervised]`` pairs whose texts join to ``problem.target``)."""
    fam = "needle_drill"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    keys, values, needles = _keyed_needles(fam, rng, num_needles, num_queries, value_digits)  # checks those knobs
    _check_positive_int(fam, "max_keys", max_keys)
    if num_queries * max_keys > num_needles:
        raise ValueError(f"{fam}: num_queries * max_keys = {num_queries} * {max_keys} must be <= num_needles="
                         f"{num_needles} (every question asks needles not asked before): lower num_queries or "
                         "max_keys, or raise num_needles")
    sizes = [rng.randint(1, max_keys) for _ in range(num_queries)]
    order = iter(rng.sample(range(num_needles), sum(sizes)))
    groups = [[next(order) for _ in range(size)] for size in sizes]  # needle indices, per question
    names = [[keys[i] for i in group] for group in groups]
    segments: list[list] = []
    for q, group in enumerate(groups):
        if q:
            segments.append(["\n" + _question(names[q]) + "\n" + ANSWER_MARKER, False])
        segments.append([" " + " , ".join(values[i] for i in group), True])
    answer = "".join(text for text, _ in segments)[1:]  # the target is " " + answer, as in every needle family
    return _build(fam, length, rng, needles, [_question(names[0]), ANSWER_MARKER], answer,
                  {"num_needles": num_needles, "num_queries": num_queries, "value_digits": value_digits,
                   "max_keys": max_keys}, False,
                  {"needles": dict(zip(keys, values)), "query_keys": [k for group in names for k in group],
                   "question_keys": names, "target_segments": segments})
