"""The record of a generated problem and the helpers that lay out its text (seeded filler, interleaving, token
costs): shared by the task families of :mod:`.tasks` and :mod:`.ruler_tasks`."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from .tokenizer import ANSWER_MARKER, count_tokens
from .vocab import FILLER_WORDS

MIN_LENGTH = 64
_HEX = "0123456789abcdef"


# --------------------------------------------------------------------------- #
# Problem container
# --------------------------------------------------------------------------- #
@dataclass
class Problem:
    family: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)

    @property
    def target(self) -> str:
        """What the model should generate after ``prompt`` (``<eos>`` excluded).

        ``reasoning``: ``"\\n" + trace + "\\nanswer : " + answer``;
        other families: ``" " + answer``.
        """
        if self.family == "reasoning":
            return "\n" + self.meta["trace"] + f"\n{ANSWER_MARKER} " + self.answer
        return " " + self.answer

    @property
    def answer_prompt(self) -> str:
        """Prompt for answer-only evaluation: for ``reasoning`` the reference
        trace is appended (teacher-forced) and the prompt ends with
        ``"answer :"``; for the other families this is just ``prompt``."""
        if self.family == "reasoning":
            return self.prompt + "\n" + self.meta["trace"] + "\n" + ANSWER_MARKER
        return self.prompt

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _as_rng(seed_or_rng: int | random.Random, family: str) -> random.Random:
    if isinstance(seed_or_rng, random.Random):
        return seed_or_rng
    if isinstance(seed_or_rng, bool) or not isinstance(seed_or_rng, int):
        raise ValueError(f"seed must be an int or random.Random, got {seed_or_rng!r}")
    # string seeds are hashed with sha512 by `random` -> stable across runs
    return random.Random(f"kvpop-testbed:{family}:{seed_or_rng}")


def _check_length(length: Any, family: str) -> int:
    if isinstance(length, bool) or not isinstance(length, int):
        raise ValueError(f"{family}: length must be an int (tokens), got {length!r}")
    if length < MIN_LENGTH:
        raise ValueError(f"{family}: length={length} is too small; minimum is {MIN_LENGTH} tokens")
    return length


def _check_positive_int(family: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{family}: {name} must be an int >= 1, got {value!r}")


def _too_small(family: str, length: int, need: int, what: str) -> ValueError:
    return ValueError(
        f"{family}: length={length} is too small for {what}; need at least {need} tokens "
        f"(increase length or reduce the knobs)"
    )


def _filler_lines(rng: random.Random, budget: int) -> list[str]:
    """Pseudo-word sentences costing exactly ``budget`` tokens including one
    newline per line (a sentence of k words costs k + 2). Budgets of 1-2 cannot
    be met and are left unused."""
    lines: list[str] = []
    rem = budget
    while rem >= 3:
        k = rem - 2 if rem <= 22 else rng.randint(6, 14)
        lines.append(" ".join(rng.choice(FILLER_WORDS) for _ in range(k)) + " .")
        rem -= k + 2
    return lines


def _interleave(rng: random.Random, filler: list[str],
                groups: Sequence[Sequence[tuple[str, Any]]]) -> list[tuple[str, Any]]:
    """Insert event lines (``(line, tag)``) at random places among ``filler``.

    The order inside each group is preserved; groups interleave randomly.
    Returns ``(line, tag)`` pairs; filler lines get tag ``None``.
    """
    n = len(filler)
    slots: list[tuple[int, float, int, str, Any]] = []
    for g in groups:
        gkey = rng.random()
        idxs = sorted(rng.randint(0, n) for _ in g)
        for j, (i, (line, tag)) in enumerate(zip(idxs, g)):
            slots.append((i, gkey, j, line, tag))
    slots.sort(key=lambda s: (s[0], s[1], s[2]))
    out: list[tuple[str, Any]] = []
    k = 0
    for i in range(n + 1):
        while k < len(slots) and slots[k][0] == i:
            out.append((slots[k][3], slots[k][4]))
            k += 1
        if i < n:
            out.append((filler[i], None))
    return out


def _cost(lines: Iterable[str]) -> int:
    """Tokens of the lines plus one newline token per line."""
    return sum(count_tokens(l) + 1 for l in lines)


def _finish(family: str, head: list[str], body: list[tuple[str, Any]], tail: list[str],
            target: str) -> tuple[str, int, dict]:
    """Join lines into the prompt; return (prompt, n_tokens, {tag: token_pos})."""
    lines = head + [l for l, _ in body] + tail
    prompt = "\n".join(lines)
    pos: dict = {}
    cur = 1 + _cost(head)  # after <bos> and the head lines (+newlines)
    for line, tag in body:
        if tag is not None:
            pos[tag] = cur
        cur += count_tokens(line) + 1
    n_tokens = 1 + count_tokens(prompt) + count_tokens(target) + 1
    return prompt, n_tokens, pos


def _fixed_cost(head: list[str], tail: list[str], target: str) -> int:
    """Tokens of everything except body lines: <bos>, head/tail lines and the
    newlines joining them, target, <eos>. Body lines then cost count + 1."""
    lines = head + tail
    return 1 + sum(count_tokens(l) for l in lines) + (len(lines) - 1) + count_tokens(target) + 1


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))
