"""Quality testbed: seeded long-context tasks and a small offline tokenizer."""

from .tasks import (
    ALL_FAMILIES,
    DRILLS,
    FAMILIES,
    MIN_LENGTH,
    Problem,
    cwe,
    fwe,
    lookup,
    make_problem,
    mixture,
    needle_drill,
    niah_multikey,
    reasoning,
    reasoning_twin,
    training_example,
    vt,
)
from .ruler_tasks import niah_multiquery, niah_multivalue
from .tokenizer import build_tokenizer, count_tokens, extract_answer, normalize

__all__ = [
    "ALL_FAMILIES",
    "DRILLS",
    "FAMILIES",
    "MIN_LENGTH",
    "Problem",
    "build_tokenizer",
    "count_tokens",
    "cwe",
    "extract_answer",
    "fwe",
    "lookup",
    "make_problem",
    "mixture",
    "needle_drill",
    "niah_multikey",
    "niah_multiquery",
    "niah_multivalue",
    "normalize",
    "reasoning",
    "reasoning_twin",
    "training_example",
    "vt",
]
