"""kvpop_lab.testbed.recall_bound: the vectorised causal recall bound equals its loop reference on random
oracles; it is 1 for identical twins, (1 + overlap) / 2 for two twins, and no causal policy's mean recall over
the twins exceeds it; reasoning twins share the context token for token and have correct traces."""

from pathlib import Path

import pytest
import torch
from kvpop_lab.bench import causal_recall_bound as bound_cli

from kvpop_lab.testbed import build_tokenizer, make_problem, reasoning_twin, training_example
from kvpop_lab.testbed.analysis import oracle_topk_recall
from kvpop_lab.testbed.recall_bound import causal_recall_bound, shared_prefix, twin_recall_rows
from references import causal_recall_bound_reference
from kvpop_hf.ops.running_topk import running_topk

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"
SCORER = ROOT / "checkpoints" / "testbed-4k-kvpop-cr88"


def _twins(m, H, S, shared, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(H, S, generator=g)
    out = base.expand(m, H, S).clone()
    out[:, :, :] += 0.7 * torch.randn(m, H, S, generator=g)  # the future differs: every score may move
    return out


@pytest.mark.parametrize("m,H,S,sinks,window,topk,shared", [
    (2, 2, 40, 2, 4, 6, 30), (3, 1, 37, 0, 1, 5, 37), (4, 2, 50, 3, 7, 9, 12), (2, 1, 20, 1, 3, 4, 0)])
def test_bound_matches_reference(m, H, S, sinks, window, topk, shared):
    o = _twins(m, H, S, shared, seed=m * 100 + S)
    fast = causal_recall_bound(o, sinks, window, topk, shared, chunk=7)
    ref = causal_recall_bound_reference(o, sinks, window, topk, shared)
    torch.testing.assert_close(fast, ref)


def test_identical_twins_bound_is_one():
    o = torch.randn(1, 2, 60).expand(3, 2, 60).clone()
    assert torch.allclose(causal_recall_bound(o, 2, 4, 8, 60), torch.ones(2, dtype=torch.float64))


def test_two_twins_bound_is_one_plus_overlap_over_two():
    S, sinks, window, topk = 48, 2, 4, 6
    o = _twins(2, 1, S, S, seed=3)
    ra, rb = (running_topk(x, sinks, window, topk) for x in o)
    t = torch.arange(S)
    vals = []
    for q in range(S):
        elig = (t >= sinks) & (t <= q - window)
        if elig.sum() <= topk:
            continue
        ka = elig & (ra.rank[0] <= ra.cutoff[0, q])
        kb = elig & (rb.rank[0] <= rb.cutoff[0, q])
        vals.append((1 + (ka & kb).sum().item() / topk) / 2)
    assert causal_recall_bound(o, sinks, window, topk, S)[0].item() == pytest.approx(sum(vals) / len(vals))


def test_no_causal_policy_beats_the_bound():
    m, H, S, sinks, window, topk, shared = 3, 2, 64, 2, 5, 8, 50
    o = _twins(m, H, S, shared, seed=11)
    bound = causal_recall_bound(o, sinks, window, topk, shared)
    for seed in range(5):  # causal: the same priorities in every twin (they cannot see past `shared`)
        prio = torch.randn(H, S, generator=torch.Generator().manual_seed(seed))
        rec = torch.stack([oracle_topk_recall(prio, o[i], sinks, window, topk) for i in range(m)]).mean(0)
        assert (rec <= bound + 1e-9).all()
    # the oracle of one twin is a causal set only when the twins agree; it still stays under the bound
    rec = torch.stack([oracle_topk_recall(o[0], o[i], sinks, window, topk) for i in range(m)]).mean(0)
    assert (rec <= bound + 1e-9).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"\[twins, H, S\]"):
        causal_recall_bound(torch.zeros(2, 5), 0, 1, 1, 5)
    with pytest.raises(ValueError, match="topk >= 1"):
        causal_recall_bound(torch.zeros(2, 1, 5), 0, 1, 0, 5)
    with pytest.raises(ValueError, match="shared must be"):
        causal_recall_bound(torch.zeros(2, 1, 5), 0, 1, 1, 9)


def test_reasoning_twin_shares_the_context_and_has_a_correct_trace():
    tok = build_tokenizer()
    p = make_problem("reasoning", length=1024, seed=5)
    twins = [reasoning_twin(p, s) for s in (1, 2, 3)]
    ids = [training_example(x, tok)["input_ids"] for x in [p] + twins]
    assert len({len(x) for x in ids}) == 1
    cut = shared_prefix(ids)
    first_rule = p.prompt.index("\nrule : ")
    assert p.prompt[:first_rule] == twins[0].prompt[:first_rule]
    assert cut >= len(ids[0]) - 200 and cut < len(ids[0])  # differs only in rules, question, trace and answer
    assert any(t.meta["rules"] != p.meta["rules"] for t in twins)
    for t in twins:
        values = dict(t.meta["facts"])
        for name, operands, ops in t.meta["rules"]:
            acc = values[operands[0]]
            for op, o in zip(ops, operands[1:]):
                acc = (acc + values[o]) % 10 if op == "+" else (acc - values[o]) % 10
            values[name] = acc
        assert t.answer == str(values[t.meta["rules"][-1][0]])
        assert t.prompt.endswith(f"question : what is y{p.meta['knobs']['steps']} ?\ntrace :")


def test_reasoning_twin_refuses_what_has_no_twin():
    with pytest.raises(ValueError, match="rules_first"):
        reasoning_twin(make_problem("reasoning", length=512, seed=0, rules_first=True), 1)
    with pytest.raises(ValueError, match="'reasoning' problem"):
        reasoning_twin(make_problem("vt", length=512, seed=0), 1)


def test_twin_rows_on_the_testbed():
    from kvpop_hf import KVpopCache
    from kvpop_lab.testbed.models import load_model
    from kvpop_hf.policies import parse_budgets
    from transformers import AutoTokenizer

    model = load_model(str(TEACHER), torch.float32, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(str(TEACHER))
    (b,) = parse_budgets(compression="0.88", length=512, sinks=4, window=32)
    scored = [("streaming", b, KVpopCache(model.config, scorer="streaming", sinks=4, window=32, topk=b.topk)),
              ("kvpop", b, KVpopCache.from_pretrained(str(SCORER), model.config, sinks=4, window=32, topk=b.topk))]
    probs = [make_problem("reasoning", length=512, seed=2 ** 48)]
    rows = twin_recall_rows(model, tok, probs, 2, scored, ["max"], progress=False)
    by = {}
    for r in rows:
        by.setdefault(r["policy"], []).append(r["recall"])
        assert 0.0 <= r["recall"] <= 1.0
    assert set(by) == {"causal_bound", "streaming", "kvpop"}
    assert len(by["causal_bound"]) == model.config.num_hidden_layers * model.config.num_key_value_heads
    for policy in ("streaming", "kvpop"):  # per layer and head the policies stay under the bound
        assert all(r <= c + 1e-9 for r, c in zip(by[policy], by["causal_bound"]))
    with pytest.raises(ValueError, match="twins must be >= 2"):
        twin_recall_rows(model, tok, probs, 1, scored, ["max"])




@pytest.mark.parametrize("extra,message", [
    (["--twins", "1"], "--twins must be >= 2"),
    (["--oracle-kinds", "max,p1"], "oracle kind"),
    (["--oracle-kinds", ","], "names no kind"),
    (["--scorer", "kvpop=/no/such/folder"], "no such checkpoint folder"),
    (["--n", "0"], "--n must be >= 1"),
])
def test_cli_refuses_bad_arguments(extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        bound_cli.parse_args(["--model", str(TEACHER), "--out", str(tmp_path)] + extra)
    assert message in capsys.readouterr().err


def test_cli_writes_its_table_csv_and_plot(tmp_path):
    import csv

    bound_cli.main(["--model", str(TEACHER), "--out", str(tmp_path), "--length", "512", "--n", "1", "--twins", "2",
                    "--window", "32", "--compression", "0.88", "--oracle-kinds", "max,mean",
                    "--scorer", f"kvpop={SCORER}", "--baselines", "streaming", "--device", "cpu"])
    table = (tmp_path / "table.md").read_text()
    for kind in ("max", "mean"):
        assert f"| {kind} | **any causal policy (bound)** | 61 |" in table and f"| {kind} | kvpop | 61 |" in table
    rows = list(csv.DictReader(open(tmp_path / "recall_per_head.csv")))
    assert {r["policy"] for r in rows} == {"causal_bound", "streaming", "kvpop"}
    assert (tmp_path / "recall_per_layer.png").stat().st_size > 0


def test_each_student_is_recorded_once_however_many_budgets_share_it():
    from helpers import distinct_ids, tiny_model

    from kvpop_lab.testbed.analysis import record_students

    student, other = tiny_model(seed=0), tiny_model(seed=1)
    calls = []
    student.register_forward_hook(lambda *a: calls.append("student"))
    other.register_forward_hook(lambda *a: calls.append("other"))
    scored = [("a", None, None, student), ("a", None, None, student), ("b", None, None, None), ("c", None, None, other)]
    rec = record_students(scored, distinct_ids(1, 10))
    assert set(rec) == {id(student), id(other)} and sorted(calls) == ["other", "student"]
    assert set(rec[id(student)]) == set(range(len(student.model.layers)))
