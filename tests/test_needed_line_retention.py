"""benchmarks/needed_line_retention.py: the needed lines of a problem and the share of them a cache holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from kvpop_lab.bench import needed_line_retention as nlr  # noqa: E402
from kvpop_hf import KVpopCache  # noqa: E402
from kvpop_lab.testbed import build_tokenizer, make_problem  # noqa: E402
from kvpop_lab.testbed.models import load_model  # noqa: E402

pytestmark = pytest.mark.tier("scripts")

TEACHER = str(ROOT / "checkpoints" / "testbed-4k-teacher")


def _lines(problem):
    tok = build_tokenizer()
    tokens = tok.convert_ids_to_tokens(tok(problem.prompt)["input_ids"])
    newline = tok.convert_ids_to_tokens(tok("a\nb", add_special_tokens=False)["input_ids"])[1]
    return tokens, nlr.needed_lines(problem, tokens, newline)


def test_needed_lines_are_the_names_and_values():
    p = make_problem("reasoning", length=1024, seed=3, n_facts=5, steps=3)
    tokens, lines = _lines(p)
    assert len(lines) == 5
    got = sorted((tokens[a], tokens[b]) for a, b in lines)  # fact : NAME = VALUE .
    assert got == sorted((name, str(value)) for name, value in p.meta["facts"].items())
    p = make_problem("vt", length=1024, seed=3)
    tokens, lines = _lines(p)
    names = [tokens[line[0]] for line in lines]  # VAR NAME = ... in assignment order
    assert names == p.answer.split()
    assert all(tokens[i] not in nlr.STRUCTURE for line in lines for i in line)
    with pytest.raises(ValueError, match="needed lines are defined"):
        nlr.needed_lines(make_problem("cwe", length=1024, seed=0), tokens, "x")


def test_a_cache_as_long_as_the_prompt_keeps_every_line_and_a_short_window_loses_some():
    model = load_model(TEACHER, torch.float32, "cpu")
    p = make_problem("vt", length=1024, seed=5)
    tok = build_tokenizer()
    ids = tok(p.prompt)["input_ids"]
    _, lines = _lines(p)
    full = KVpopCache(model.config, sinks=4, window=64, topk=len(ids), scorer="knorm")
    tokens, whole = nlr.kept_share(nlr.stored_after_prefill(model, full, torch.tensor([ids])), lines)
    assert tokens.shape == whole.shape == (6, 2) and bool((tokens == 1).all()) and bool((whole == 1).all())
    short = KVpopCache(model.config, sinks=4, window=64, topk=0, scorer="streaming")
    tokens, whole = nlr.kept_share(nlr.stored_after_prefill(model, short, torch.tensor([ids])), lines)
    assert float(tokens.max()) < 1.0


def test_bad_families_are_refused_before_loading(tmp_path):
    with pytest.raises(SystemExit, match="needed lines are defined"):
        nlr.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "t.md"), "--families", "cwe"])


@pytest.mark.parametrize("flags, error, match", [
    (["--budgets", "0.88"], ValueError, "give it as --compression 0.88"),
    (["--compression", "492"], ValueError, "give it as --budgets 492"),
    (["--compression", "0.88", "--budgets", "300"], SystemExit, "one budget; got 2"),
])
def test_one_budget_of_either_kind_is_checked_before_loading(tmp_path, flags, error, match):
    with pytest.raises(error, match=match):
        nlr.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "t.md"), *flags])


def test_lookup_attention_matches_the_models_own_attention_weights():
    from transformers import AutoModelForCausalLM

    from kvpop_lab.testbed.qkv import record_qkv
    from kvpop_lab.testbed.tasks import training_example

    tok = build_tokenizer()
    p = make_problem("reasoning", length=512, seed=7, n_facts=4, steps=2)
    ids = tok(p.prompt)["input_ids"]
    full = torch.tensor([training_example(p, tok)["input_ids"]])
    _, lines = _lines(p)
    model = load_model(TEACHER, torch.float32, "cpu")
    queries = nlr.lookup_queries(p, full[0].tolist(), len(ids), tok)
    words = tok.convert_ids_to_tokens(full[0].tolist())
    assert len(queries) >= 2 and all(words[t] == "=" and words[t - 1] in p.meta["facts"] for t in queries)
    assert all(t >= len(ids) for t in queries)  # in the target only
    assert nlr.lookup_queries(make_problem("vt", length=512, seed=1), [0] * 10, 6, tok) == [6, 7, 8, 9]
    got = nlr.lookup_attention(record_qkv(model, full), queries, lines)
    eager = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        att = eager(full, output_attentions=True).attentions  # per layer [1, Hq, S, S]
    need = [i for line in lines for i in line]
    ref = torch.stack([a[0][:, queries][:, :, need].sum(-1).view(2, -1, len(queries)).amax(1).mean(-1)
                       for a in att])
    assert got.shape == (6, 2)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert float(got.max()) > 0.05  # some head of a lookup query attends to the facts
    with pytest.raises(ValueError, match="no lookup queries"):
        nlr.lookup_attention(record_qkv(model, full), [], lines)


def test_fact_line_kinds_and_the_by_token_table(tmp_path):
    tok = build_tokenizer()
    p = make_problem("reasoning", length=512, seed=4, n_facts=4, steps=2)
    tokens, _ = _lines(p)
    newline = tok.convert_ids_to_tokens(tok("a\nb", add_special_tokens=False)["input_ids"])[1]
    kinds = nlr.fact_line_kinds(p, tokens, newline)
    assert all(len(v) == 4 for v in kinds.values())
    assert {tokens[i] for i in kinds["."]} == {"."} and {tokens[i] for i in kinds["="]} == {"="}
    assert sorted(tokens[i] for i in kinds["name"]) == sorted(p.meta["facts"])
    out = tmp_path / "t.md"
    nlr.main(["--model", TEACHER, "--scorer-checkpoint", str(ROOT / "checkpoints/testbed-4k-kvpop-cr88"),
              "--out", str(out), "--per-head", str(tmp_path / "h.csv"), "--families", "reasoning", "--n", "1",
              "--length", "768", "--compression", "0.75", "--knob", "reasoning.n_facts=4",
              "--knob", "reasoning.steps=2"])
    text = out.read_text()
    assert "| kvpop | `.` |" in text and "| streaming | `value` |" in text
    assert len((tmp_path / "h.csv").read_text().splitlines()) == 1 + 2 * 12
