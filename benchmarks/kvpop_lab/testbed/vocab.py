"""Closed vocabulary shared by the task generators and the testbed tokenizer.

Everything the generators in :mod:`kvpop_lab.testbed.tasks` can emit is built
from the pieces defined here:

* ``FIXED_WORDS`` -- the handful of English template words and punctuation
  marks used by the prompt templates (each one token);
* ``PSEUDO_WORDS`` -- a deterministic list of pronounceable nonsense words
  (each one token) used for filler text, names, keys and word lists;
* single digits and the hex letters ``a``-``f`` in word-initial form plus
  ``##``-prefixed continuation form, so numbers, variable names such as
  ``x17`` and UUID-like strings are spelled one character per token;
* ``NEWLINE`` (the pilcrow), which the tokenizer substitutes for ``\\n``.

Canonical text is whitespace separated: punctuation is always written as a
separate word (``x17 = 4 .``), and the only multi-character words that are
split into several tokens are numbers, variable names beyond ``x255`` and
UUID-like strings (``x0``..``x255``, ``y0``.., ``z0``.. are single tokens).
"""

from __future__ import annotations

import random
import re

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]

NEWLINE = "\u00b6"  # pilcrow; the tokenizer's normaliser maps "\n" to it
CONT = "##"  # WordPiece continuation prefix

DIGITS = list("0123456789")
HEX_LETTERS = list("abcdef")
# single letters that start variable names (x17, y3, z40)
NAME_LETTERS = ["x", "y", "z"]
# whole variable names are single tokens (WordPiece matches the longest piece first), so a small
# model can look a fact up by matching one token instead of a spelled-out name
NAME_WORDS = [f"{letter}{i}" for letter in NAME_LETTERS for i in range(256)]

PUNCT = [".", ",", ":", ";", "?", "=", "+", "-", "(", ")"]

FIXED_WORDS = [
    # reasoning
    "problem", "facts", "fact", "note", "rule", "question", "trace", "answer",
    "all", "arithmetic", "is", "mod", "ten", "what", "compute",
    # variable tracking
    "VAR", "memorize", "the", "variable", "assignments", "below", "find",
    "variables", "that", "are", "assigned", "value",
    # needles
    "some", "special", "magic", "numbers", "uuids", "number", "uuid",
    "hidden", "in", "text", "them", "one", "of", "for", "mentioned",
    # word lists
    "list", "words", "read", "track", "how", "often", "each", "word",
    "appears", "and", "most", "common", "frequent", "above", "give", "order",
    "first", "appearance", "by", "frequency", "three",
]

_HEX_ONLY = re.compile(r"^[a-f]+$")

N_PSEUDO_WORDS = 1536
N_FILLER_WORDS = 256  # PSEUDO_WORDS[:N_FILLER_WORDS] are used for filler only

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v",
           "z", "h", "j", "w", "br", "dr", "gr", "kr", "pl", "st", "tr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m"]


def _make_pseudo_words(n: int, seed: int = 20240611) -> list[str]:
    """Deterministic, sorted-by-creation list of ``n`` distinct nonsense words.

    Words are 2-3 syllables, lower case, never entirely made of hex letters
    (so they cannot swallow the start of a UUID chunk) and never collide with
    a template word or a single letter.
    """
    rng = random.Random(seed)
    taken = set(FIXED_WORDS) | set(HEX_LETTERS) | set(NAME_LETTERS)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        n_syl = rng.choice((2, 2, 3))
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n_syl))
        w += rng.choice(_CODAS)
        if w in seen or w in taken or _HEX_ONLY.match(w):
            continue
        seen.add(w)
        out.append(w)
    return out


PSEUDO_WORDS: list[str] = _make_pseudo_words(N_PSEUDO_WORDS)
FILLER_WORDS: list[str] = PSEUDO_WORDS[:N_FILLER_WORDS]
ENTITY_WORDS: list[str] = PSEUDO_WORDS[N_FILLER_WORDS:]


def vocabulary() -> list[str]:
    """The full ordered token list (ids are list positions)."""
    toks: list[str] = list(SPECIAL_TOKENS)
    toks += [NEWLINE]
    toks += DIGITS + [CONT + d for d in DIGITS]
    toks += HEX_LETTERS + [CONT + c for c in HEX_LETTERS]
    toks += NAME_LETTERS
    toks += [CONT + "-"]  # hyphen inside UUID-like strings
    toks += PUNCT
    toks += NAME_WORDS
    toks += FIXED_WORDS
    toks += PSEUDO_WORDS
    if len(set(toks)) != len(toks):  # pragma: no cover - guards edits above
        dup = sorted({t for t in toks if toks.count(t) > 1})
        raise RuntimeError(f"duplicate vocabulary entries: {dup}")
    for t in FIXED_WORDS:
        if len(t) > 1 and _HEX_ONLY.match(t):  # pragma: no cover
            raise RuntimeError(f"template word {t!r} is hex-only and would break UUIDs")
    return toks
