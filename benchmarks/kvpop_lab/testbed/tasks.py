"""Seeded long-context task generators for the KV-eviction quality testbed.

Every generator returns a :class:`Problem` whose ``prompt`` ends exactly where
the model has to start generating. All text is *canonical* (see
:mod:`kvpop_lab.testbed.vocab`): whitespace-separated words, punctuation as
separate words, ``"\\n"`` between lines, so it tokenizes without ``<unk>``
and round-trips through :func:`kvpop_lab.testbed.tokenizer.normalize`.

Length convention
-----------------
``length`` is measured in tokens of the testbed tokenizer and refers to the
full training sequence ``<bos> prompt target <eos>`` where ``target`` is
:meth:`Problem.target` (for ``reasoning`` that is the whole reference trace
plus the answer line; for the other families it is ``" " + answer``). The
generators pad with filler so the total hits ``length`` exactly (at worst a
couple of tokens short); ``meta["n_tokens"]`` holds the exact count.

Families
--------
``reasoning``      facts ``x17 = 4`` scattered among filler and ``z``-distractors,
                   a small mod-10 program over them, and a step-by-step trace.
``vt``             RULER-style variable tracking (``VAR a = 12345``, ``VAR b = VAR a``).
``niah_multikey``  several key -> value needles (numbers or UUID-like), query one.
``cwe``            common-words extraction (a few words repeated many times).
``fwe``            frequent-words extraction (Zipf-distributed words, top 3).
``niah_multivalue``, ``niah_multiquery``
                   RULER-style needles: one key with several values, several keys asked at once
                   (:mod:`kvpop_lab.testbed.ruler_tasks`; in :data:`ALL_FAMILIES`, not in :data:`FAMILIES`).
``lookup``         the teacher's fact-recall drill (training only).
"""

from __future__ import annotations

import inspect
import math
import random
from typing import Any, Callable, Iterator, Mapping, Sequence

from .problem import (MIN_LENGTH, _HEX, Problem, _as_rng, _check_length, _check_positive_int, _too_small, _filler_lines, _interleave, _cost, _finish, _fixed_cost, _number)  # noqa: F401  (Problem, MIN_LENGTH: re-exported)
from .needle_drill import needle_drill
from .ruler_tasks import RULER_FAMILIES, check_flag, key_link, multikey_question, restated
from .tokenizer import ANSWER_MARKER, count_tokens, encode_plain
from .vocab import ENTITY_WORDS, PSEUDO_WORDS

__all__ = [
    "Problem",
    "FAMILIES",
    "MIN_LENGTH",
    "make_problem",
    "reasoning",
    "reasoning_twin",
    "vt",
    "niah_multikey",
    "cwe",
    "fwe",
    "lookup",
    "needle_drill",
    "ALL_FAMILIES",
    "DRILLS",
    "training_example",
    "mixture",
]

def _uuid(rng: random.Random, groups: Sequence[int] = (8, 4, 4, 4, 12)) -> str:
    return "-".join("".join(rng.choice(_HEX) for _ in range(g)) for g in groups)


def _distractor_lines(rng: random.Random, id_range: int, budget: float
                      ) -> tuple[dict[str, int], list[tuple[str, Any]], int]:
    """``note : z17 = 3 .`` lines (distinct ``z`` names below ``id_range``) until the next would push their
    token cost (one newline each included) past ``budget``. Returns ``({name: value}, [(line, None)], cost)``."""
    distractors: dict[str, int] = {}
    lines: list[tuple[str, Any]] = []
    cost = 0
    while True:
        zi = rng.randrange(id_range)
        zname = f"z{zi}"
        if zname in distractors:
            if len(distractors) >= id_range:
                break
            continue
        zval = rng.randint(0, 9)
        line = f"note : {zname} = {zval} ."
        c = count_tokens(line) + 1
        if cost + c > budget:
            break
        distractors[zname] = zval
        lines.append((line, None))
        cost += c
    return distractors, lines, cost


# --------------------------------------------------------------------------- #
# reasoning traces
# --------------------------------------------------------------------------- #
def _apply(a: int, op: str, b: int) -> int:
    return (a + b) % 10 if op == "+" else (a - b) % 10


def _trace_line(name: str, operands: list[str], ops: list[str], values: dict,
                restate: bool = True) -> tuple[str, int]:
    """One trace line and the value it computes.

    ``restate=True``: ``y2 = y1 - x40 ; y1 = 1 ; x40 = 9 ; 1 - 9 = 2 ; y2 = 2 .`` -- every operand is
    looked up on its own (``x40 = 9`` repeats the fact line's own words, so the lookup is a plain copy
    of what followed ``x40 =`` earlier in the context) and the line ends by restating its result.
    ``restate=False`` (the first testbed version): ``y2 = y1 - x40 = 1 - 9 = 2 .``.
    """
    expr = [operands[0]]
    for op, o in zip(ops, operands[1:]):
        expr += [op, o]
    vals = [values[o] for o in operands]
    # reduce left to right, one binary op per "=" so every step is single-digit
    red: list[str] = []
    cur, rest_ops, rest_vals = vals[0], list(ops), vals[1:]
    while rest_ops:
        s = [str(cur)]
        for op, v in zip(rest_ops, rest_vals):
            s += [op, str(v)]
        red.append(" ".join(s))
        cur = _apply(cur, rest_ops[0], rest_vals[0])
        rest_ops, rest_vals = rest_ops[1:], rest_vals[1:]
    red.append(str(cur))
    if not restate:
        return " = ".join([f"{name} = {' '.join(expr)}"] + red) + " .", cur
    segs = [f"{name} = {' '.join(expr)}"] + [f"{o} = {values[o]}" for o in operands]
    segs += [" = ".join(red), f"{name} = {cur}"]
    return " ; ".join(segs) + " .", cur


def _draw_program(rng: random.Random, facts: dict[str, int], steps: int, hops: int, restate: bool
                  ) -> tuple[list[list], dict[str, int], str, str, list[str]]:
    """A program of ``steps`` rules over ``facts`` (each x operand preferably a fact not used yet; from step 2
    on one operand is the previous result). Returns ``(rules, values, trace, answer, rule_lines)``: rules as
    ``[name, operands, ops]``, every fact and result value, the reference trace, the last result, and the
    ``rule : ...`` lines of the prompt."""
    fact_names = list(facts)
    values: dict[str, int] = dict(facts)
    pool: list[str] = []
    rules: list[list] = []
    trace_lines: list[str] = []
    for s in range(1, steps + 1):
        name = f"y{s}"
        operands: list[str] = [] if s == 1 else [f"y{s - 1}"]
        while len(operands) < hops:
            if not pool:
                pool = fact_names[:]
                rng.shuffle(pool)
            cand = pool.pop()
            if cand not in operands:
                operands.append(cand)
        rng.shuffle(operands)
        ops = [rng.choice("+-") for _ in range(hops - 1)]
        line, val = _trace_line(name, operands, ops, values, restate)
        values[name] = val
        rules.append([name, operands, ops])
        trace_lines.append(line)
    rule_lines = []
    for name, operands, ops in rules:
        expr = [operands[0]]
        for op, o in zip(ops, operands[1:]):
            expr += [op, o]
        rule_lines.append(f"rule : {name} = {' '.join(expr)} .")
    return rules, values, "\n".join(trace_lines), str(values[f"y{steps}"]), rule_lines


def _question_lines(steps: int) -> list[str]:
    """The last lines of a reasoning prompt: the question about the program's last result, then ``trace :``."""
    return [f"question : what is y{steps} ?", "trace :"]


def reasoning(seed: int | random.Random = 0, length: int = 1024, n_facts: int | None = None,
              steps: int | None = None, hops: int = 2, distractor_density: float = 0.1,
              rules_first: bool = False, restate: bool = True) -> Problem:
    """Mod-10 multi-step reasoning over facts scattered in a long context.

    The body holds ``fact : x17 = 4 .`` lines (``n_facts``), ``note : z17 = 3 .``
    distractors and pseudo-word filler. A program of ``steps`` rules
    (``rule : y2 = y1 - x40 .``, each combining ``hops`` operands; from step 2
    on one operand is the previous result, so the answer depends on every
    step) is stated after the body (before it if ``rules_first``). The prompt
    ends with ``"trace :"``; the reference trace (``meta["trace"]``) evaluates
    one rule per line: it restates the rule, looks every operand up on its
    own (``x40 = 9`` -- the words of the fact line), reduces one binary
    operation per ``=`` and restates the result::

        y2 = y1 - x40 + x8 ; y1 = 1 ; x40 = 9 ; x8 = 8 ; 1 - 9 + 8 = 2 + 8 = 0 ; y2 = 0 .

    (``restate=False`` gives the first version's shorter lines,
    ``y2 = y1 - x40 + x8 = 1 - 9 + 8 = 2 + 8 = 0 .``, where a value has to be
    found from a name several tokens back -- a small model learns that far
    more slowly.)

    and is followed by ``answer : <value of the last y>``.

    Knobs: ``n_facts`` (default ``clamp(length // 96, 6, 64)``), ``steps``
    (default ``clamp(length // 256, 3, 12)``), ``hops`` >= 2 operands per
    step, ``distractor_density`` in [0, 1): share of the filler token budget
    spent on ``z`` distractor statements.
    """
    fam = "reasoning"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    n_facts = max(6, min(64, length // 96)) if n_facts is None else n_facts
    steps = max(3, min(12, length // 256)) if steps is None else steps
    if not isinstance(hops, int) or hops < 2:
        raise ValueError(f"{fam}: hops must be an int >= 2 (operands per step), got {hops!r}")
    _check_positive_int(fam, "steps", steps)
    if not isinstance(n_facts, int) or n_facts < hops:
        raise ValueError(f"{fam}: n_facts must be an int >= hops={hops}, got {n_facts!r}")
    if not 0.0 <= distractor_density < 1.0:
        raise ValueError(f"{fam}: distractor_density must be in [0, 1), got {distractor_density!r}")
    check_flag(fam, "rules_first", rules_first)
    check_flag(fam, "restate", restate)

    id_range = max(100, 4 * n_facts)
    facts = {f"x{i}": rng.randint(0, 9) for i in rng.sample(range(id_range), n_facts)}

    rules, values, trace, answer, rule_lines = _draw_program(rng, facts, steps, hops, restate)

    head = ["problem : all arithmetic is mod ten ."] + (rule_lines if rules_first else [])
    tail = ([] if rules_first else rule_lines) + _question_lines(steps)
    target = "\n" + trace + f"\n{ANSWER_MARKER} " + answer

    fact_lines = [(f"fact : {n} = {v} .", n) for n, v in facts.items()]
    rng.shuffle(fact_lines)
    body_budget = length - _fixed_cost(head, tail, target)
    need = _cost(l for l, _ in fact_lines)
    if body_budget < need:
        raise _too_small(fam, length, length - body_budget + need,
                         f"n_facts={n_facts}, steps={steps}, hops={hops}")
    free = body_budget - need
    distractors, d_lines, d_cost = _distractor_lines(rng, id_range, distractor_density * free)
    filler = _filler_lines(rng, free - d_cost)
    body = _interleave(rng, filler, [[e] for e in fact_lines] + [[d] for d in d_lines])
    prompt, n_tokens, pos = _finish(fam, head, body, tail, target)
    meta = {
        "facts": facts,
        "distractors": distractors,
        "rules": rules,
        "values": values,
        "trace": trace,
        "fact_token_pos": pos,
        "target_token_start": n_tokens - 1 - count_tokens(target),
        "n_tokens": n_tokens,
        "knobs": {"length": length, "n_facts": n_facts, "steps": steps, "hops": hops,
                  "distractor_density": distractor_density, "rules_first": rules_first,
                  "restate": restate},
    }
    return Problem(fam, prompt, answer, meta)


def reasoning_twin(problem: Problem, seed: int | random.Random) -> Problem:
    """The same context with another question: ``problem``'s facts, distractors and filler word for word, a
    new program of as many rules (drawn with ``seed``) and its trace and answer.

    The twin's prompt shares every token up to the first ``rule :`` line with ``problem``'s and has the same
    length (a rule line and a trace line cost the same tokens whatever their names and values). A causal
    policy therefore decides the same for both up to there; :mod:`kvpop_lab.testbed.recall_bound` uses this to
    bound the oracle top-k recall any such policy can reach. Only problems with the rules after the body
    (``rules_first=False``) have twins."""
    if problem.family != "reasoning":
        raise ValueError(f"reasoning_twin needs a 'reasoning' problem, got family {problem.family!r}")
    knobs = problem.meta["knobs"]
    if knobs["rules_first"]:
        raise ValueError("reasoning_twin: a problem with rules_first=True states its rules before the body, so "
                         "no twin shares the context; generate the problems with rules_first=False")
    rng = _as_rng(seed, "reasoning")
    facts = problem.meta["facts"]
    steps = knobs["steps"]
    rules, values, trace, answer, rule_lines = _draw_program(rng, facts, steps, knobs["hops"], knobs["restate"])
    prefix = problem.prompt[:problem.prompt.index("\nrule : ")]
    twin = Problem("reasoning", "\n".join([prefix] + rule_lines + _question_lines(steps)), answer,
                   dict(problem.meta, rules=rules, values=values, trace=trace))
    n_tokens = 1 + count_tokens(twin.prompt) + count_tokens(twin.target) + 1
    if n_tokens != problem.meta["n_tokens"]:  # cannot happen with single-token names; a guard for the bound
        raise ValueError(f"reasoning_twin: the twin has {n_tokens} tokens, the problem {problem.meta['n_tokens']}")
    twin.meta["target_token_start"] = n_tokens - 1 - count_tokens(twin.target)
    return twin


# --------------------------------------------------------------------------- #
# RULER-style families
# --------------------------------------------------------------------------- #
def vt(seed: int | random.Random = 0, length: int = 1024, num_chains: int = 1,
       num_hops: int = 4) -> Problem:
    """Variable tracking: chains ``VAR a = 12345 .``, ``VAR b = VAR a .`` ...

    ``num_chains`` chains (chain 0 is queried; the others are distractors with
    different values) of ``num_hops`` re-assignments each, spread through
    filler. Answer: the ``num_hops + 1`` names of chain 0 in assignment order,
    space separated.
    """
    fam = "vt"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    _check_positive_int(fam, "num_chains", num_chains)
    _check_positive_int(fam, "num_hops", num_hops)
    n_names = num_chains * (num_hops + 1)
    if n_names > len(ENTITY_WORDS):
        raise ValueError(f"{fam}: num_chains * (num_hops + 1) must be <= {len(ENTITY_WORDS)}")
    names = rng.sample(ENTITY_WORDS, n_names)
    vals: list[str] = []
    while len(vals) < num_chains:
        v = _number(rng, 5)
        if v not in vals:
            vals.append(v)
    chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
    groups = []
    for c, chain in enumerate(chains):
        g = [(f"VAR {chain[0]} = {vals[c]} .", (c, 0))]
        g += [(f"VAR {chain[h]} = VAR {chain[h - 1]} .", (c, h)) for h in range(1, len(chain))]
        groups.append(g)
    answer = " ".join(chains[0])
    head = ["memorize the variable assignments below ."]
    tail = [f"question : find all variables that are assigned the value {vals[0]} .", ANSWER_MARKER]
    target = " " + answer
    body_budget = length - _fixed_cost(head, tail, target)
    need = _cost(l for g in groups for l, _ in g)
    if body_budget < need:
        raise _too_small(fam, length, length - body_budget + need,
                         f"num_chains={num_chains}, num_hops={num_hops}")
    body = _interleave(rng, _filler_lines(rng, body_budget - need), groups)
    prompt, n_tokens, pos = _finish(fam, head, body, tail, target)
    meta = {
        "chains": chains,
        "values": vals,
        "statement_token_pos": [[pos[(c, h)] for h in range(num_hops + 1)] for c in range(num_chains)],
        "n_tokens": n_tokens,
        "knobs": {"length": length, "num_chains": num_chains, "num_hops": num_hops},
    }
    return Problem(fam, prompt, answer, meta)


def niah_multikey(seed: int | random.Random = 0, length: int = 1024, num_needles: int = 4,
                  value_kind: str = "number", value_digits: int = 7,
                  uuid_groups: Sequence[int] = (8, 4, 4, 4, 12), restate_key: bool = False,
                  adjacent_key: bool = False) -> Problem:
    """Multi-key needle in a haystack.

    ``num_needles`` lines ``one of the special magic numbers for <k1> <k2> is :
    <value> .`` (keys are distinct pseudo-word pairs) among filler; one key is
    queried. ``value_kind="number"`` gives ``value_digits``-digit numbers,
    ``"uuid"`` gives hex strings grouped by ``uuid_groups`` joined with ``-``.
    ``restate_key=True`` ends the prompt with an answer prefix in the needle's
    words, ``answer : the special magic number for <k1> <k2> is :`` (as RULER's
    prefix restates the key), so the value follows the same words as in its
    needle; the default ends it with ``answer :``. ``adjacent_key=True`` drops
    ``is`` from the needles and the prefix (``... for <k1> <k2> : <value> .``):
    the token before the value is then the key's last word, which a model that
    copies by the previous token alone (induction) can match.
    """
    fam = "niah_multikey"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    if value_kind not in ("number", "uuid"):
        raise ValueError(f"{fam}: value_kind must be 'number' or 'uuid', got {value_kind!r}")
    _check_positive_int(fam, "num_needles", num_needles)
    _check_positive_int(fam, "value_digits", value_digits)
    check_flag(fam, "restate_key", restate_key)
    check_flag(fam, "adjacent_key", adjacent_key)
    if not uuid_groups or any((not isinstance(g, int)) or g < 1 for g in uuid_groups):
        raise ValueError(f"{fam}: uuid_groups must be positive ints, got {uuid_groups!r}")
    if 2 * num_needles > len(ENTITY_WORDS):
        raise ValueError(f"{fam}: num_needles must be <= {len(ENTITY_WORDS) // 2}")
    kw = rng.sample(ENTITY_WORDS, 2 * num_needles)
    keys = [f"{kw[2 * i]} {kw[2 * i + 1]}" for i in range(num_needles)]
    values: list[str] = []
    while len(values) < num_needles:
        v = _number(rng, value_digits) if value_kind == "number" else _uuid(rng, uuid_groups)
        if v not in values:
            values.append(v)
    noun, nouns = ("number", "numbers") if value_kind == "number" else ("uuid", "uuids")
    link = key_link(adjacent_key)
    needles = [(f"one of the special magic {nouns} for {k} {link} {v} .", i)
               for i, (k, v) in enumerate(zip(keys, values))]
    q = rng.randrange(num_needles)
    answer = values[q]
    head = [f"some special magic {nouns} are hidden in the text below . memorize them ."]
    marker = f"{ANSWER_MARKER} {restated(keys[q], link, noun)}" if restate_key else ANSWER_MARKER
    tail = [multikey_question(keys[q], noun), marker]
    target = " " + answer
    body_budget = length - _fixed_cost(head, tail, target)
    need = _cost(l for l, _ in needles)
    if body_budget < need:
        raise _too_small(fam, length, length - body_budget + need,
                         f"num_needles={num_needles}, value_kind={value_kind!r}")
    body = _interleave(rng, _filler_lines(rng, body_budget - need), [[n] for n in needles])
    prompt, n_tokens, pos = _finish(fam, head, body, tail, target)
    meta = {
        "needles": dict(zip(keys, values)),
        "query_key": keys[q],
        "needle_token_pos": [pos[i] for i in range(num_needles)],
        "n_tokens": n_tokens,
        "knobs": {"length": length, "num_needles": num_needles, "value_kind": value_kind,
                  "value_digits": value_digits, "uuid_groups": list(uuid_groups), "restate_key": restate_key,
                  "adjacent_key": adjacent_key},
    }
    return Problem(fam, prompt, answer, meta)


def _word_lines(words: list[str], per_line: int) -> list[str]:
    return [" ".join(words[i:i + per_line]) for i in range(0, len(words), per_line)]


def _max_words(budget: int, per_line: int) -> int:
    """Largest W with W + ceil(W / per_line) <= budget (words + newlines)."""
    w = max(0, budget * per_line // (per_line + 1))
    while w > 0 and w + math.ceil(w / per_line) > budget:
        w -= 1
    return w


def cwe(seed: int | random.Random = 0, length: int = 1024, n_common: int = 10,
        freq_common: int | None = None, freq_uncommon: int = 3,
        words_per_line: int = 16) -> Problem:
    """Common-words extraction.

    A shuffled list where ``n_common`` words occur ``freq_common`` times each
    and every other word at most ``freq_common - 2`` times (normally
    ``freq_uncommon``; raised automatically when the pseudo-word pool would
    run out at long lengths). Answer: the common words in order of first
    appearance. ``freq_common`` defaults to ``clamp(0.25 * n_words /
    n_common, 4, 30)``.
    """
    fam = "cwe"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    for nm, v, lo in (("n_common", n_common, 1), ("freq_uncommon", freq_uncommon, 1),
                      ("words_per_line", words_per_line, 1)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{fam}: {nm} must be an int >= {lo}, got {v!r}")
    if freq_common is not None and (not isinstance(freq_common, int) or freq_common < 3):
        raise ValueError(f"{fam}: freq_common must be an int >= 3, got {freq_common!r}")
    if n_common >= len(PSEUDO_WORDS):
        raise ValueError(f"{fam}: n_common must be < {len(PSEUDO_WORDS)}")
    head = ["read the list of words below and track how often each word appears ."]
    tail = [f"question : what are the {n_common} most common words in the list above ? "
            "give them in order of first appearance .", ANSWER_MARKER]
    # the target is n_common single-token words
    fixed = _fixed_cost(head, tail, "") + n_common
    n_words = _max_words(length - fixed, words_per_line)
    auto = freq_common is None
    fc = max(4, min(30, int(0.25 * n_words / n_common))) if auto else freq_common
    n_avail = len(PSEUDO_WORDS) - n_common
    while True:
        u = n_words - n_common * fc
        fu = max(freq_uncommon, math.ceil(max(u, 0) / n_avail))
        if fu + 2 <= fc or not auto:
            break
        fc = fu + 2
    if u < 0:
        raise _too_small(fam, length, fixed + n_common * fc + math.ceil(n_common * fc / words_per_line),
                         f"n_common={n_common}, freq_common={fc}")
    if fu + 2 > fc:
        raise ValueError(f"{fam}: freq_common={fc} must exceed the uncommon frequency {fu} by >= 2 "
                         f"(increase freq_common or lower freq_uncommon/length)")
    n_unc, r = divmod(u, fu)
    chosen = rng.sample(PSEUDO_WORDS, n_common + n_unc + (1 if r else 0))
    common, uncommon = chosen[:n_common], chosen[n_common:]
    counts = {w: fc for w in common}
    counts.update({w: fu for w in uncommon[:n_unc]})
    if r:
        counts[uncommon[n_unc]] = r
    words = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(words)
    first = {}
    for i, w in enumerate(words):
        first.setdefault(w, i)
    answer = " ".join(sorted(common, key=first.__getitem__))
    body = [(l, None) for l in _word_lines(words, words_per_line)]
    target = " " + answer
    prompt, n_tokens, _ = _finish(fam, head, body, tail, target)
    meta = {
        "common_words": sorted(common, key=first.__getitem__),
        "freq_common": fc,
        "freq_uncommon": fu,
        "n_words": len(words),
        "n_tokens": n_tokens,
        "knobs": {"length": length, "n_common": n_common, "freq_common": freq_common,
                  "freq_uncommon": freq_uncommon, "words_per_line": words_per_line},
    }
    return Problem(fam, prompt, answer, meta)


def fwe(seed: int | random.Random = 0, length: int = 1024, alpha: float = 2.0,
        vocab_size: int | None = None, top_k: int = 3, words_per_line: int = 16,
        max_tries: int = 100, restate_question: bool = False, word_pool: int | None = None,
        pool_start: int = 0) -> Problem:
    """Frequent-words extraction.

    Words are sampled i.i.d. from a truncated Zipf law ``p(rank r) ~ r**-alpha``
    over ``vocab_size`` pseudo-words (default ``clamp(n_words // 8, 32,
    pool)``); samples are redrawn until the ``top_k`` counts are strictly
    ordered and above the next one. Answer: the ``top_k`` words, most
    frequent first. ``restate_question=True`` ends the prompt with an answer
    prefix in the question's words, ``answer : the <top_k> most frequent words
    are :`` (as RULER's prefix does), instead of ``answer :`` alone, which the
    needle families share; the text then loses its last words to the prefix.
    ``word_pool`` draws the words from ``word_pool`` pseudo-words, from number
    ``pool_start`` on, instead of all of them (the default ``vocab_size`` is
    then at most ``word_pool``): fewer words a model must tell apart in its
    output. The first 256 pseudo-words are the filler words of every other
    family (``vocab.FILLER_WORDS``), so ``word_pool=256`` draws fwe's words from
    the filler and ``pool_start=256`` from the other words.
    """
    fam = "fwe"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    _check_positive_int(fam, "top_k", top_k)
    _check_positive_int(fam, "words_per_line", words_per_line)
    check_flag(fam, "restate_question", restate_question)
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"{fam}: alpha must be > 0, got {alpha!r}")
    head = ["read the text below and track how often each word appears ."]
    marker = f"{ANSWER_MARKER} the {top_k} most frequent words are :" if restate_question else ANSWER_MARKER
    tail = [f"question : what are the {top_k} most frequent words in the text above ? "
            "give them in order of frequency .", marker]
    fixed = _fixed_cost(head, tail, "") + top_k
    n_words = _max_words(length - fixed, words_per_line)
    if n_words < 4 * (top_k + 1):
        raise _too_small(fam, length, fixed + 5 * (top_k + 1), f"top_k={top_k}")
    if isinstance(pool_start, bool) or not isinstance(pool_start, int) or not 0 <= pool_start < len(PSEUDO_WORDS):
        raise ValueError(f"{fam}: pool_start must be an int in [0, {len(PSEUDO_WORDS)}), got {pool_start!r}")
    n_left = len(PSEUDO_WORDS) - pool_start
    if word_pool is None:
        word_pool = n_left
    if isinstance(word_pool, bool) or not isinstance(word_pool, int) or not top_k < word_pool <= n_left:
        raise ValueError(f"{fam}: word_pool must be an int in ({top_k}, {n_left}] (the pseudo-words from "
                         f"pool_start={pool_start} on), got {word_pool!r}")
    if vocab_size is None:
        vocab_size = max(min(32, word_pool), min(word_pool, n_words // 8))
    if not isinstance(vocab_size, int) or not top_k < vocab_size <= word_pool:
        raise ValueError(f"{fam}: vocab_size must be an int in ({top_k}, {word_pool}] (word_pool), "
                         f"got {vocab_size!r}")
    ranked = rng.sample(PSEUDO_WORDS[pool_start:pool_start + word_pool], vocab_size)
    cum, tot = [], 0.0
    for r in range(vocab_size):
        tot += (r + 1) ** -float(alpha)
        cum.append(tot)
    for _ in range(max_tries):
        idx = rng.choices(range(vocab_size), cum_weights=cum, k=n_words)
        counts: dict[str, int] = {}
        for i in idx:
            counts[ranked[i]] = counts.get(ranked[i], 0) + 1
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:top_k + 1]
        cs = [c for _, c in top] + [0]
        if len(top) >= top_k and all(cs[i] > cs[i + 1] for i in range(top_k)):
            break
    else:
        raise ValueError(f"{fam}: could not draw a strictly ordered top-{top_k} in {max_tries} "
                         f"tries (alpha={alpha}, n_words={n_words}); raise alpha or length")
    words = [ranked[i] for i in idx]
    answer_words = [w for w, _ in top[:top_k]]
    body = [(l, None) for l in _word_lines(words, words_per_line)]
    target = " " + " ".join(answer_words)
    prompt, n_tokens, _ = _finish(fam, head, body, tail, target)
    meta = {
        "top_words": answer_words,
        "top_counts": [c for _, c in top[:top_k + 1]],
        "n_words": n_words,
        "vocab_size": vocab_size,
        "n_tokens": n_tokens,
        "knobs": {"length": length, "alpha": alpha, "vocab_size": vocab_size, "top_k": top_k,
                  "words_per_line": words_per_line, "restate_question": restate_question, "word_pool": word_pool,
                  "pool_start": pool_start},
    }
    return Problem(fam, prompt, " ".join(answer_words), meta)


def lookup(seed: int | random.Random = 0, length: int = 512, n_facts: int | None = None,
           n_queries: int | None = None, distractor_density: float = 0.1) -> Problem:
    """Lookup drill (a training family, not one of the evaluated :data:`FAMILIES`).

    The body holds ``fact : x17 = 4 .`` lines and ``note : z17 = 3 .`` distractors among filler, as in
    :func:`reasoning`; the question lists ``n_queries`` of the fact names and the answer restates each,
    ``x17 = 4 ; x3 = 9 ; ...`` -- exactly the lookup segments of a reasoning trace, so every other
    target token is a value copied from far back. It exists to teach that copy to a small teacher.
    Knobs: ``n_facts`` (default ``clamp(length // 48, 4, 64)``), ``n_queries`` (default ``n_facts``),
    ``distractor_density`` as in :func:`reasoning`.
    """
    fam = "lookup"
    length = _check_length(length, fam)
    rng = _as_rng(seed, fam)
    n_facts = max(4, min(64, length // 48)) if n_facts is None else n_facts
    _check_positive_int(fam, "n_facts", n_facts)
    n_queries = n_facts if n_queries is None else n_queries
    _check_positive_int(fam, "n_queries", n_queries)
    if n_queries > n_facts:
        raise ValueError(f"{fam}: n_queries={n_queries} must be <= n_facts={n_facts}")
    if not 0.0 <= distractor_density < 1.0:
        raise ValueError(f"{fam}: distractor_density must be in [0, 1), got {distractor_density!r}")
    id_range = max(100, 4 * n_facts)
    facts = {f"x{i}": rng.randint(0, 9) for i in rng.sample(range(id_range), n_facts)}
    queries = rng.sample(list(facts), n_queries)
    answer = " ; ".join(f"{q} = {facts[q]}" for q in queries)
    head = ["problem : recall the facts ."]
    tail = ["question : " + " ".join(queries) + " ?", ANSWER_MARKER]
    target = " " + answer
    fact_lines = [(f"fact : {n} = {v} .", n) for n, v in facts.items()]
    rng.shuffle(fact_lines)
    body_budget = length - _fixed_cost(head, tail, target)
    need = _cost(l for l, _ in fact_lines)
    if body_budget < need:
        raise _too_small(fam, length, length - body_budget + need, f"n_facts={n_facts}, n_queries={n_queries}")
    free = body_budget - need
    _, d_lines, d_cost = _distractor_lines(rng, id_range, distractor_density * free)
    body = _interleave(rng, _filler_lines(rng, free - d_cost), [[e] for e in fact_lines] + [[d] for d in d_lines])
    prompt, n_tokens, pos = _finish(fam, head, body, tail, target)
    meta = {"facts": facts, "queries": queries, "fact_token_pos": pos, "n_tokens": n_tokens,
            "knobs": {"length": length, "n_facts": n_facts, "n_queries": n_queries,
                      "distractor_density": distractor_density}}
    return Problem(fam, prompt, answer, meta)


# --------------------------------------------------------------------------- #
# dispatch, training examples, mixtures
# --------------------------------------------------------------------------- #
_REGISTRY: dict[str, Callable[..., Problem]] = {
    "reasoning": reasoning,
    "vt": vt,
    "niah_multikey": niah_multikey,
    "cwe": cwe,
    "fwe": fwe,
    "lookup": lookup,
    "needle_drill": needle_drill,
}
#: the RULER-style needles of :mod:`.ruler_tasks`
_RULER: tuple[str, ...] = ("niah_multivalue", "niah_multiquery")
#: the evaluated families (paper Tables 1/2 analogues)
FAMILIES: tuple[str, ...] = ("reasoning", "vt", "niah_multikey", "cwe", "fwe")
#: every generator: the evaluated families, the RULER-style ones and the training-only drills (lookup, needle_drill)
ALL_FAMILIES: tuple[str, ...] = tuple(_REGISTRY) + _RULER
#: the training-only drills: generators for a teacher's mixture, never an evaluated or held-out family
DRILLS: tuple[str, ...] = ("lookup", "needle_drill")


def _generator(family: str) -> Callable[..., Problem]:
    if family in _RULER:
        return RULER_FAMILIES[family]
    return _REGISTRY[family]


def make_problem(family: str, length: int = 1024, seed: int = 0, **knobs: Any) -> Problem:
    """Generate one problem of ``family`` (see :data:`FAMILIES`).

    Same arguments -> identical text. Unknown families or knobs raise
    ``ValueError`` naming the valid choices.
    """
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid families: {', '.join(ALL_FAMILIES)}")
    fn = _generator(family)
    valid = [p for p in inspect.signature(fn).parameters if p not in ("seed", "length")]
    bad = sorted(set(knobs) - set(valid))
    if bad:
        raise ValueError(f"{family}: unknown knob(s) {bad}; valid knobs: {', '.join(valid)}")
    return fn(seed, length=length, **knobs)


def training_example(problem: Problem, tokenizer: Any, mode: str = "trace",
                     prompt_loss: bool = False) -> dict:
    """Tokenize ``<bos> context target <eos>`` with labels.

    ``mode="trace"`` (default): context = ``problem.prompt``, target =
    ``problem.target`` (for ``reasoning`` the whole trace + answer line is
    supervised). ``mode="answer"``: context = ``problem.answer_prompt`` (the
    reference trace is part of the context) and only ``" " + answer`` is
    supervised. Context positions get label -100 unless ``prompt_loss``. A problem whose
    ``meta["target_segments"]`` lists ``[text, supervised]`` pairs (:func:`.needle_drill.needle_drill`) has the
    unsupervised pieces of its target labelled -100 in ``"trace"`` mode.
    ``tokenizer`` is the HF tokenizer from :func:`build_tokenizer` (or the raw
    backend). Returns ``{"input_ids": [...], "labels": [...]}``.
    """
    if mode not in ("trace", "answer"):
        raise ValueError(f"mode must be 'trace' or 'answer', got {mode!r}")
    if mode == "trace":
        context, target = problem.prompt, problem.target
    else:
        context, target = problem.answer_prompt, " " + problem.answer
    bos = tokenizer.token_to_id("<bos>") if not hasattr(tokenizer, "bos_token_id") else tokenizer.bos_token_id
    eos = tokenizer.token_to_id("<eos>") if not hasattr(tokenizer, "eos_token_id") else tokenizer.eos_token_id
    ctx_ids = [bos] + encode_plain(tokenizer, context)
    tgt_ids = encode_plain(tokenizer, target) + [eos]
    tgt_labels = list(tgt_ids)
    segments = problem.meta.get("target_segments") if mode == "trace" else None
    if segments:  # a drill whose target holds unsupervised words: those positions get -100
        pieces = [(encode_plain(tokenizer, text), sup) for text, sup in segments]
        if "".join(text for text, _ in segments) != target or sum((ids for ids, _ in pieces), []) != tgt_ids[:-1]:
            raise ValueError(f"{problem.family}: meta['target_segments'] do not tokenize to the target")
        tgt_labels = sum((ids if sup else [-100] * len(ids) for ids, sup in pieces), []) + [eos]
    labels = ([-100] + ctx_ids[1:] if prompt_loss else [-100] * len(ctx_ids)) + tgt_labels
    return {"input_ids": ctx_ids + tgt_ids, "labels": labels}


def mixture(families: Sequence[str] | Mapping[str, float] = FAMILIES, n: int | None = 1000,
            length_range: int | tuple[int, int] = (512, 2048), seed: int = 0,
            knobs: Mapping[str, Mapping[str, Any]] | None = None) -> Iterator[Problem]:
    """Seeded stream of problems for training.

    ``families``: names (uniform) or ``{name: weight}``; ``n``: number of
    problems (``None`` = endless); ``length_range``: ``(lo, hi)`` inclusive,
    or a single int; ``knobs``: ``{family: {knob: value}}`` passed to the
    generator. Each problem gets its own derived seed, so the stream is
    reproducible for a given ``seed``.
    """
    if isinstance(families, Mapping):
        names, weights = list(families), [float(w) for w in families.values()]
    else:
        names, weights = list(families), None
    if not names:
        raise ValueError("families must not be empty")
    for f in names:
        if f not in ALL_FAMILIES:
            raise ValueError(f"unknown family {f!r}; valid families: {', '.join(ALL_FAMILIES)}")
    lo, hi = (length_range, length_range) if isinstance(length_range, int) else tuple(length_range)
    if lo > hi or lo < MIN_LENGTH:
        raise ValueError(f"length_range must satisfy {MIN_LENGTH} <= lo <= hi, got {length_range!r}")
    knobs = dict(knobs or {})
    rng = random.Random(f"kvpop-testbed-mixture:{seed}")
    i = 0
    while n is None or i < n:
        fam = rng.choices(names, weights=weights)[0]
        length = rng.randint(lo, hi)
        pseed = rng.getrandbits(48)
        yield make_problem(fam, length=length, seed=pseed, **dict(knobs.get(fam, {})))
        i += 1
