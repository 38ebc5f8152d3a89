"""Tests for the testbed task generators and tokenizer (fast, CPU only)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from kvpop_lab.testbed import (
    FAMILIES,
    build_tokenizer,
    count_tokens,
    extract_answer,
    make_problem,
    mixture,
    normalize,
    training_example,
)
from kvpop_lab.testbed import generate

pytestmark = pytest.mark.tier("scripts")

LENGTHS = (512, 2048)
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _problems():
    for fam in FAMILIES:
        for length in LENGTHS:
            for seed in SEEDS:
                yield fam, length, seed


# ----------------------------------------------------------------- determinism
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_per_seed(family):
    a = make_problem(family, length=1024, seed=7)
    b = make_problem(family, length=1024, seed=7)
    c = make_problem(family, length=1024, seed=8)
    assert a.to_dict() == b.to_dict()
    assert a.prompt != c.prompt


def test_mixture_deterministic_and_covers_families():
    a = [p.to_dict() for p in mixture(FAMILIES, n=20, length_range=(256, 600), seed=3)]
    b = [p.to_dict() for p in mixture(FAMILIES, n=20, length_range=(256, 600), seed=3)]
    assert a == b
    assert {p["family"] for p in a} == set(FAMILIES)
    assert all(256 * 0.9 <= p["meta"]["n_tokens"] <= 600 for p in a)
    only = list(mixture({"vt": 1.0, "cwe": 0.0}, n=5, length_range=512, seed=0))
    assert {p.family for p in only} == {"vt"}


# ------------------------------------------------------------- token lengths
@pytest.mark.parametrize("family,length,seed", list(_problems()))
def test_length_and_tokenizer_roundtrip(tok, family, length, seed):
    p = make_problem(family, length=length, seed=seed)
    ex = training_example(p, tok)
    n = len(ex["input_ids"])
    assert abs(n - length) <= 0.1 * length, (family, length, n)
    assert n == p.meta["n_tokens"]
    assert tok.unk_token_id not in ex["input_ids"]
    # round trip: canonical text survives encode/decode modulo whitespace
    assert normalize(p.prompt) == p.prompt
    ids = tok(p.prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) == count_tokens(p.prompt)
    assert normalize(tok.decode(ids)) == p.prompt
    # the generated part decodes to something extract_answer maps to the answer
    tgt = ex["input_ids"][len(ex["input_ids"]) - sum(l != -100 for l in ex["labels"]):]
    assert extract_answer(tok.decode(tgt, skip_special_tokens=False)) == p.answer
    assert extract_answer(tok.decode(tgt, skip_special_tokens=True)) == p.answer
    assert normalize(tok.decode(tgt, skip_special_tokens=True)) == normalize(p.target)


def test_knobbed_lengths(tok):
    cases = [
        ("reasoning", dict(hops=3, steps=6, n_facts=30, distractor_density=0.3, rules_first=True)),
        ("niah_multikey", dict(value_kind="uuid", num_needles=8)),
        ("vt", dict(num_chains=3, num_hops=3)),
        ("cwe", dict(n_common=5, freq_common=20)),
        ("fwe", dict(alpha=1.5)),
    ]
    for fam, knobs in cases:
        p = make_problem(fam, length=2048, seed=5, **knobs)
        ids = training_example(p, tok)["input_ids"]
        assert abs(len(ids) - 2048) <= 205 and tok.unk_token_id not in ids, fam


# ---------------------------------------------------------- answer checking
_FACT = re.compile(r"^fact : (x\d+) = (\d) \.$")
_RULE = re.compile(r"^rule : (y\d+) = (.+) \.$")


def _eval_left_to_right(tokens):
    acc = int(tokens[0])
    for op, v in zip(tokens[1::2], tokens[2::2]):
        acc = (acc + int(v)) % 10 if op == "+" else (acc - int(v)) % 10
    return acc


def _check_reasoning(p):
    lines = p.prompt.split("\n")
    facts = dict((m.group(1), int(m.group(2))) for m in map(_FACT.match, lines) if m)
    rules = [(m.group(1), m.group(2).split()) for m in map(_RULE.match, lines) if m]
    assert len(facts) == p.meta["knobs"]["n_facts"]
    assert lines[-1] == "trace :" and lines[-2] == f"question : what is {rules[-1][0]} ?"
    env = dict(facts)
    trace = p.meta["trace"].split("\n")
    assert len(trace) == len(rules)
    restate = p.meta["knobs"]["restate"]
    for line, (name, expr) in zip(trace, rules):
        assert line.endswith(" .")
        if restate:  # "y2 = y1 - x4 ; y1 = 3 ; x4 = 9 ; 3 - 9 = 4 ; y2 = 4 ."
            segs = line[:-2].split(" ; ")
            operands = [t for t in expr if t not in "+-"]
            assert segs[0] == f"{name} = {' '.join(expr)}" and len(segs) == len(operands) + 3
            assert segs[1:-2] == [f"{o} = {env[o]}" for o in operands]
            line = f"{segs[0]} = {segs[-2]} ."
            assert segs[-1] == f"{name} = {line.split(' = ')[-1][:-2]}"
        parts = line[:-2].split(" = ")
        assert parts[0] == name and parts[1].split() == expr
        # restated operand values must match the facts / earlier results
        subst = [str(env[t]) if t not in "+-" else t for t in expr]
        assert parts[2].split() == subst
        # every further "=" performs exactly one binary operation
        for prev, cur in zip(parts[2:], parts[3:]):
            pt, ct = prev.split(), cur.split()
            assert len(ct) == len(pt) - 2
            assert ct == [str(_eval_left_to_right(pt[:3]))] + pt[3:]
        env[name] = _eval_left_to_right(expr_values := parts[2].split())
        assert parts[-1] == str(env[name]) and len(expr_values) >= 3
    assert p.answer == str(env[rules[-1][0]])
    # distractors never feed the program
    assert not any(t.startswith("z") for _, e in rules for t in e)


def _check_vt(p):
    assign = {}
    order = []
    for line in p.prompt.split("\n"):
        m = re.match(r"^VAR (\w+) = (?:VAR (\w+)|(\d+)) \.$", line)
        if m:
            name, src, val = m.groups()
            assign[name] = val if val else assign[src]  # source must already be defined
            order.append(name)
    q = re.search(r"assigned the value (\d+) \.\nanswer :$", p.prompt).group(1)
    assert p.answer == " ".join(n for n in order if assign[n] == q)


def _check_niah(p):
    knobs = p.meta["knobs"]
    kind = knobs["value_kind"]
    noun = "numbers" if kind == "number" else "uuids"
    link = ":" if knobs["adjacent_key"] else "is :"
    needles = dict(re.findall(rf"^one of the special magic {noun} for (\w+ \w+) {link} (\S+) \.$",
                              p.prompt, flags=re.M))
    assert len(needles) == knobs["num_needles"]
    key = re.search(r"for (\w+ \w+) mentioned in the text \?\nanswer :", p.prompt).group(1)
    prefix = f" the special magic {noun[:-1]} for {key} {link}" if knobs["restate_key"] else ""
    assert p.prompt.endswith(f"mentioned in the text ?\nanswer :{prefix}")
    assert p.answer == needles[key]
    if kind == "uuid":
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", p.answer)
    else:
        assert re.fullmatch(r"[1-9]\d{6}", p.answer)


def _body_words(p):
    lines = p.prompt.split("\n")
    return " ".join(lines[1:-2]).split()


def _check_cwe(p):
    words = _body_words(p)
    counts = Counter(words)
    n = int(re.search(r"what are the (\d+) most common", p.prompt).group(1))
    ranked = counts.most_common()
    top = {w for w, _ in ranked[:n]}
    assert ranked[n - 1][1] > ranked[n][1]  # unambiguous top-n
    first = sorted(top, key=words.index)
    assert p.answer == " ".join(first)


def _check_fwe(p):
    words = _body_words(p)
    ranked = Counter(words).most_common()
    cs = [c for _, c in ranked[:4]]
    assert cs[0] > cs[1] > cs[2] > cs[3]
    assert p.answer == " ".join(w for w, _ in ranked[:3])


_CHECKERS = {"reasoning": _check_reasoning, "vt": _check_vt, "niah_multikey": _check_niah,
             "cwe": _check_cwe, "fwe": _check_fwe}


@pytest.mark.parametrize("family,length,seed", list(_problems()))
def test_answers_recomputed(family, length, seed):
    _CHECKERS[family](make_problem(family, length=length, seed=seed))


@pytest.mark.parametrize("restate_key,adjacent_key", [(False, True), (True, False), (True, True)])
def test_niah_multikey_layouts(restate_key, adjacent_key):
    """The layout knobs change the words around the key, not the draw: same keys, values and asked needle as the
    default layout, and the answer recomputed from the prompt."""
    base = make_problem("niah_multikey", length=1024, seed=5)
    p = make_problem("niah_multikey", length=1024, seed=5, restate_key=restate_key, adjacent_key=adjacent_key)
    _check_niah(p)
    assert (p.meta["needles"], p.meta["query_key"], p.answer) == (base.meta["needles"], base.meta["query_key"],
                                                                   base.answer)
    assert (" is : " not in p.prompt) == adjacent_key


@pytest.mark.parametrize("restate_key,adjacent_key", [(False, False), (False, True), (True, False), (True, True)])
def test_niah_multiquery_layouts(restate_key, adjacent_key):
    """niah_multiquery's layout knobs: the same draw as the default layout; with restate_key each asked key comes
    before its value in the needle's words (the first in the answer prefix); the answer recomputed from the prompt."""
    base = make_problem("niah_multiquery", length=1024, seed=7, num_needles=5, num_queries=3)
    p = make_problem("niah_multiquery", length=1024, seed=7, num_needles=5, num_queries=3, restate_key=restate_key,
                     adjacent_key=adjacent_key)
    link = ":" if adjacent_key else "is :"
    needles = dict(re.findall(rf"^one of the special magic numbers for (\w+ \w+) {link} (\d+) \.$", p.prompt,
                              flags=re.M))
    assert len(needles) == 5 and (" is : " not in p.prompt) == adjacent_key
    asked = re.search(r"numbers for (\w+ \w+) , (\w+ \w+) and (\w+ \w+) mentioned", p.prompt).groups()
    assert (needles, list(asked)) == (base.meta["needles"], base.meta["query_keys"])
    assert p.meta["query_values"] == base.meta["query_values"] == [needles[k] for k in asked]
    if restate_key:
        assert p.prompt.endswith(f"\nanswer : the special magic number for {asked[0]} {link}")
        assert p.answer == " , ".join([needles[asked[0]]] + [f"the special magic number for {k} {link} {needles[k]}"
                                                              for k in asked[1:]])
    else:
        assert p.prompt.endswith("\nanswer :") and p.answer == base.answer == " , ".join(needles[k] for k in asked)
    with pytest.raises(ValueError, match="restate_key must be True or False"):
        make_problem("niah_multiquery", length=512, seed=0, restate_key=1)
    with pytest.raises(ValueError, match="adjacent_key must be True or False"):
        make_problem("niah_multiquery", length=512, seed=0, adjacent_key="no")


def test_fwe_restates_the_question():
    """fwe's answer prefix: the prompt ends in the question's words, the length is kept (the text is shorter) and the
    answer is still the top three words of the text, recomputed from the prompt."""
    from kvpop_lab.testbed.tokenizer import count_tokens
    p = make_problem("fwe", length=2048, seed=3, restate_question=True)
    assert p.prompt.endswith("\nanswer : the 3 most frequent words are :")
    assert count_tokens(p.prompt + " " + p.answer) == count_tokens(make_problem("fwe", length=2048, seed=3).prompt
                                                                   + " " + p.answer)
    _check_fwe(p)
    assert p.meta["knobs"]["restate_question"] is True
    with pytest.raises(ValueError, match="restate_question must be True or False"):
        make_problem("fwe", length=512, seed=0, restate_question="yes")


def test_fwe_word_pool():
    """fwe's word_pool and pool_start: every word of the text comes from the word_pool pseudo-words from pool_start
    on, the answer is still the text's top three; the full pool is the default draw; a pool that is too small, runs
    past the pseudo-words or is not an int is refused."""
    from kvpop_lab.testbed.vocab import FILLER_WORDS, PSEUDO_WORDS
    p = make_problem("fwe", length=2048, seed=4, word_pool=64)
    assert set(_body_words(p)) <= set(PSEUDO_WORDS[:64]) <= set(FILLER_WORDS) and p.meta["vocab_size"] == 64
    _check_fwe(p)
    q = make_problem("fwe", length=2048, seed=4, word_pool=64, pool_start=256)
    assert set(_body_words(q)) <= set(PSEUDO_WORDS[256:320]) and not set(_body_words(q)) & set(FILLER_WORDS)
    _check_fwe(q)
    assert make_problem("fwe", length=2048, seed=4, word_pool=len(PSEUDO_WORDS)).prompt == \
        make_problem("fwe", length=2048, seed=4).prompt
    for bad in (3, len(PSEUDO_WORDS) + 1, 64.0, True):
        with pytest.raises(ValueError, match="word_pool must be an int"):
            make_problem("fwe", length=512, seed=0, word_pool=bad)
    with pytest.raises(ValueError, match="word_pool must be an int in \\(3, 36\\]"):
        make_problem("fwe", length=512, seed=0, word_pool=64, pool_start=len(PSEUDO_WORDS) - 36)
    for bad in (-1, len(PSEUDO_WORDS), "0"):
        with pytest.raises(ValueError, match="pool_start must be an int"):
            make_problem("fwe", length=512, seed=0, pool_start=bad)
    with pytest.raises(ValueError, match=r"vocab_size must be an int in \(3, 64\] \(word_pool\)"):
        make_problem("fwe", length=512, seed=0, word_pool=64, vocab_size=100)


@pytest.mark.parametrize("knobs", [dict(hops=3), dict(hops=4, steps=5, rules_first=True),
                                   dict(distractor_density=0.5), dict(restate=False), dict(hops=3, restate=False)])
def test_reasoning_knobs(knobs):
    for seed in range(3):
        p = make_problem("reasoning", length=1536, seed=seed, **knobs)
        _check_reasoning(p)
        if knobs.get("rules_first"):
            assert p.prompt.split("\n")[1].startswith("rule :")
        if knobs.get("distractor_density"):
            assert len(p.meta["distractors"]) > 0


def test_more_families_knobs():
    _check_niah(make_problem("niah_multikey", length=1024, seed=2, value_kind="uuid"))
    _check_vt(make_problem("vt", length=1024, seed=2, num_chains=4, num_hops=2))
    _check_cwe(make_problem("cwe", length=4096, seed=2, n_common=3))


def test_reasoning_delays():
    p = make_problem("reasoning", length=4096, seed=0)
    pos = p.meta["fact_token_pos"]
    start = p.meta["target_token_start"]
    delays = [start - pos[x] for x in pos]
    assert max(delays) > 1000 and min(delays) > 0


# ----------------------------------------------------------- training example
def test_training_example_masks(tok):
    p = make_problem("reasoning", length=512, seed=0)
    ex = training_example(p, tok)
    sup = [t for t, l in zip(ex["input_ids"], ex["labels"]) if l != -100]
    assert sup == ex["labels"][-len(sup):]
    assert ex["input_ids"][0] == tok.bos_token_id and sup[-1] == tok.eos_token_id
    assert normalize(tok.decode(sup, skip_special_tokens=True)) == normalize(p.target)
    assert "y1 =" in tok.decode(sup)  # the trace is supervised
    ans = training_example(p, tok, mode="answer")
    sup2 = [t for t, l in zip(ans["input_ids"], ans["labels"]) if l != -100]
    assert tok.decode(sup2, skip_special_tokens=True).strip() == p.answer
    assert len(ans["input_ids"]) == len(ex["input_ids"])  # same tokens, different mask
    q = make_problem("vt", length=512, seed=0)
    ex = training_example(q, tok)
    sup = [t for t, l in zip(ex["input_ids"], ex["labels"]) if l != -100]
    assert tok.decode(sup, skip_special_tokens=True).strip() == q.answer
    full = training_example(q, tok, prompt_loss=True)
    assert full["labels"][0] == -100 and full["labels"][1:] == full["input_ids"][1:]


def test_extract_answer_robust():
    assert extract_answer(" 1234567 <eos> question : junk") == "1234567"
    assert extract_answer("\ny1 = x3 + x4 = 1 + 2 = 3 .\n answer :   7 \n<eos>") == "7"
    assert extract_answer("  kelo   mabu\n\nmore") == "kelo mabu"
    assert normalize("a  b \n  c\t d ") == "a b\nc d"


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_basics(tok):
    assert 300 <= len(tok) <= 2500
    assert tok.convert_ids_to_tokens(tok("x17 = 4 .")["input_ids"]) == ["<bos>", "x17", "=", "4", "."]
    assert tok.convert_ids_to_tokens(tok("x300 = 42")["input_ids"]) == ["<bos>", "x30", "##0", "=", "4", "##2"]
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.bos_token == "<bos>"
    assert "token_type_ids" not in tok("a b")


def test_save_load_offline(tok, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    p = make_problem("niah_multikey", length=512, seed=4, value_kind="uuid")
    assert loaded(p.prompt)["input_ids"] == tok(p.prompt)["input_ids"]
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert normalize(loaded.decode(loaded(p.prompt)["input_ids"], skip_special_tokens=True)) == p.prompt


# ------------------------------------------------------------------ bad input
def test_bad_inputs():
    with pytest.raises(ValueError, match="valid families: reasoning"):
        make_problem("nope", length=512, seed=0)
    with pytest.raises(ValueError, match="too small"):
        make_problem("vt", length=10, seed=0)
    with pytest.raises(ValueError, match="too small"):
        make_problem("reasoning", length=128, seed=0, n_facts=40)
    with pytest.raises(ValueError, match="too small"):
        make_problem("cwe", length=100, seed=0, freq_common=30)
    with pytest.raises(ValueError, match="valid knobs"):
        make_problem("vt", length=512, seed=0, hops=3)
    with pytest.raises(ValueError, match="value_kind"):
        make_problem("niah_multikey", length=512, seed=0, value_kind="word")
    with pytest.raises(ValueError, match="restate_key must be True or False"):
        make_problem("niah_multikey", length=512, seed=0, restate_key="yes")
    with pytest.raises(ValueError, match="reasoning: restate must be True or False"):
        make_problem("reasoning", length=512, seed=0, restate=0)
    with pytest.raises(ValueError, match="reasoning: rules_first must be True or False"):
        make_problem("reasoning", length=512, seed=0, rules_first="no")
    with pytest.raises(ValueError, match="adjacent_key must be True or False"):
        make_problem("niah_multikey", length=512, seed=0, adjacent_key=1)
    with pytest.raises(ValueError, match="hops"):
        make_problem("reasoning", length=512, seed=0, hops=1)
    with pytest.raises(ValueError, match="length must be an int"):
        make_problem("fwe", length="512", seed=0)
    with pytest.raises(ValueError, match="unknown family"):
        next(mixture(["vt", "bogus"], n=1))


# ------------------------------------------------------------------------ CLI
def test_cli(tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    generate.main(["--family", "reasoning", "--n", "3", "--length", "512", "--seed", "0",
                   "--out", str(out)])
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(recs) == 3 and {"prompt", "answer", "family", "meta", "target"} <= set(recs[0])
    assert recs[0]["prompt"] == make_problem("reasoning", length=512, seed=0).prompt
    assert "trace" in recs[0]["meta"]
    generate.main(["--family", "niah_multikey", "--n", "1", "--length", "512",
                   "--knob", "value_kind=uuid"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["meta"]["knobs"]["value_kind"] == "uuid"
    with pytest.raises(SystemExit):
        generate.main(["--family", "vt", "--length", "20"])


@pytest.mark.parametrize("length,knobs", [(256, {}), (1024, {"n_queries": 5}), (512, {"distractor_density": 0.5})])
def test_lookup_drill_restates_queried_facts(tok, length, knobs):
    from kvpop_lab.testbed import ALL_FAMILIES

    assert "lookup" in ALL_FAMILIES and "lookup" not in FAMILIES  # a training drill, not evaluated
    for seed in range(3):
        p = make_problem("lookup", length=length, seed=seed, **knobs)
        lines = p.prompt.split("\n")
        facts = dict((m.group(1), int(m.group(2))) for m in map(_FACT.match, lines) if m)
        assert facts == p.meta["facts"]
        queries = lines[-2].removeprefix("question : ").removesuffix(" ?").split()
        assert queries == p.meta["queries"] and len(queries) == knobs.get("n_queries", len(facts))
        assert p.answer == " ; ".join(f"{q} = {facts[q]}" for q in queries)
        assert abs(p.meta["n_tokens"] - length) <= 2
        assert len(training_example(p, tok)["input_ids"]) == p.meta["n_tokens"]


def test_lookup_drill_bad_knobs():
    with pytest.raises(ValueError, match="n_queries=9 must be <= n_facts=4"):
        make_problem("lookup", length=256, n_facts=4, n_queries=9)
    with pytest.raises(ValueError, match="too small"):
        make_problem("lookup", length=64, n_facts=30)


@pytest.mark.parametrize("family,knobs", [("niah_multivalue", {"num_values": 3}),
                                          ("niah_multiquery", {"num_needles": 6, "num_queries": 2})])
def test_ruler_families_registered(tok, family, knobs):
    """The RULER-style needles are make_problem families (teacher pretraining, retrofit data, kvpop-eval), scored
    like the others: the supervised target decodes to the answer with its commas."""
    from kvpop_lab.testbed import ALL_FAMILIES
    from kvpop_lab.testbed.ruler_tasks import RULER_FAMILIES
    from kvpop_lab.testbed.training_rows import testbed_rows

    from kvpop_lab.testbed.tasks import _RULER

    assert family in ALL_FAMILIES and family not in FAMILIES and set(_RULER) == set(RULER_FAMILIES)
    p = make_problem(family, length=700, seed=5, **knobs)
    assert p == RULER_FAMILIES[family](5, length=700, **knobs)
    ex = training_example(p, tok)
    assert len(ex["input_ids"]) == p.meta["n_tokens"] and tok.unk_token_id not in ex["input_ids"]
    tgt = ex["input_ids"][len(ex["input_ids"]) - sum(l != -100 for l in ex["labels"]):]
    assert extract_answer(tok.decode(tgt, skip_special_tokens=True)) == p.answer and " , " in p.answer
    assert {q.family for q in mixture([family, "vt"], n=6, length_range=400, seed=1)} == {family, "vt"}
    rows = testbed_rows(f"{family},reasoning", tok, 512, 4, seed=0, knobs=[f"{family}.value_digits=5"])
    assert len(rows) == 4 and all(r["input_ids"].shape == (512,) for r in rows)
    with pytest.raises(ValueError, match="unknown knob.*valid knobs: "):
        make_problem(family, length=700, n_facts=3)


@pytest.mark.parametrize("length,knobs", [(256, {}), (1024, {"num_needles": 8, "num_queries": 4}),
                                          (600, {"num_needles": 2, "num_queries": 1, "value_digits": 5}),
                                          (700, {"num_needles": 9, "num_queries": 3, "max_keys": 3}),
                                          (500, {"max_keys": 1})])
def test_needle_drill_supervises_only_the_answers(tok, length, knobs):
    """The drill asks niah_multikey's question (one key) or niah_multiquery's (several) in the prompt and more in the
    target; every asked key is a needle's, asked once; only the answers (and <eos>) carry a label."""
    from kvpop_lab.testbed import ALL_FAMILIES, DRILLS
    from kvpop_lab.testbed.ruler_tasks import multiquery_question

    assert "needle_drill" in ALL_FAMILIES and "needle_drill" in DRILLS and "needle_drill" not in FAMILIES
    mk = make_problem("niah_multikey", length=length, seed=0).prompt.split("\n")[-2]
    mq = make_problem("niah_multiquery", length=max(length, 512), seed=0)
    assert mq.prompt.split("\n")[-2] == multiquery_question(mq.meta["query_keys"])

    def question(keys):  # the evaluated families' questions, as their prompts show them
        if len(keys) == 1:
            return mk.replace(mk.split(" for ")[1].split(" mentioned")[0], keys[0])
        return multiquery_question(keys)

    sizes = set()
    for seed in range(8):
        p = make_problem("needle_drill", length=length, seed=seed, **knobs)
        needles, groups = p.meta["needles"], p.meta["question_keys"]
        assert len(needles) == knobs.get("num_needles", 6) and len(groups) == knobs.get("num_queries", 3)
        asked = [k for g in groups for k in g]
        assert asked == p.meta["query_keys"] and len(asked) == len(set(asked)) and set(asked) <= set(needles)
        assert all(1 <= len(g) <= knobs.get("max_keys", 2) for g in groups)
        sizes.update(len(g) for g in groups)
        for key, value in needles.items():
            assert f"one of the special magic numbers for {key} is : {value} ." in p.prompt
        assert p.prompt.endswith(question(groups[0]) + "\nanswer :")
        ex = training_example(p, tok)
        assert len(ex["input_ids"]) == p.meta["n_tokens"] and abs(p.meta["n_tokens"] - length) <= 2
        sup = [t for t, lab in zip(ex["input_ids"], ex["labels"]) if lab != -100]
        assert sup[-1] == tok.eos_token_id
        answers = " ".join(" , ".join(needles[k] for k in g) for g in groups)
        assert normalize(tok.decode(sup[:-1], skip_special_tokens=True).replace(",", " , ")) == normalize(answers)
        # the target's unsupervised tokens are the follow-up questions, word for word
        n_tgt = count_tokens(p.target) + 1
        unsup = [t for t, lab in zip(ex["input_ids"][-n_tgt:], ex["labels"][-n_tgt:]) if lab == -100]
        assert normalize(tok.decode(unsup, skip_special_tokens=True)) == normalize(
            "".join(f"\n{question(g)}\nanswer :" for g in groups[1:]))
        # answer mode has no segments: the whole target is supervised
        full = training_example(p, tok, mode="answer")
        assert sum(lab != -100 for lab in full["labels"]) == n_tgt == len(sup) + len(unsup)
    assert sizes == set(range(1, knobs.get("max_keys", 2) + 1)) or knobs.get("num_needles") == 2


def test_needle_drill_bad_input(tok):
    with pytest.raises(ValueError, match="num_queries=5 must be <= num_needles=4"):
        make_problem("needle_drill", length=512, num_needles=4, num_queries=5)
    with pytest.raises(ValueError, match=r"num_queries \* max_keys = 3 \* 3 must be <= num_needles=6"):
        make_problem("needle_drill", length=512, max_keys=3)
    with pytest.raises(ValueError, match="max_keys must be"):
        make_problem("needle_drill", length=512, max_keys=0)
    with pytest.raises(ValueError, match="too small"):
        make_problem("needle_drill", length=128)
    p = make_problem("needle_drill", length=400, seed=1)
    p.meta["target_segments"][0][0] = " 1"  # segments that no longer spell the target
    with pytest.raises(ValueError, match="target_segments"):
        training_example(p, tok)
