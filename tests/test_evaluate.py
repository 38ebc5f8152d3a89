"""The evaluation CLI `kvpop-eval` (kvpop_lab.testbed.evaluate) end to end on a tiny Qwen3, plus its helpers."""

import csv
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from kvpop_hf import KVpopCache
from kvpop_lab.testbed import FAMILIES, build_tokenizer, make_problem, training_example
from kvpop_hf import policies
from kvpop_lab.testbed import analysis
from kvpop_lab.testbed.evaluate import build_parser, main, plan_from_args

pytestmark = pytest.mark.tier("scripts")

LENGTH, WINDOW, SINKS = 300, 32, 4
FULL_B = 1000  # > length + generated tokens: never evicts


def _tiny_trained_model(tok, steps=60):
    """Tiny random-init Qwen3 over the testbed vocabulary, briefly trained so that its teacher-forced
    token accuracy is not zero (otherwise "equals dense" would be vacuous)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    exs = [training_example(make_problem(f, length=LENGTH, seed=s), tok) for s in range(6) for f in FAMILIES]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        batch = [exs[(4 * step + j) % len(exs)] for j in range(4)]
        L = min(len(e["input_ids"]) for e in batch)
        ids = torch.tensor([e["input_ids"][:L] for e in batch])
        labels = torch.tensor([e["labels"][:L] for e in batch])
        model(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tok = build_tokenizer()
    model = _tiny_trained_model(tok)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    ck = KVpopCache(model.config, sinks=SINKS, window=WINDOW, topk=100, scorer="mlp")
    with torch.no_grad():
        for p in ck.scorer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ck.save_pretrained(root / "ckpts" / "kvpop_mlp")
    out = root / "out"
    argv = ["--model", str(root / "model"), "--out", str(out), "--n", "2", "--length", str(LENGTH),
            "--sinks", str(SINKS), "--window", str(WINDOW), "--compression", "0.5", "--budgets", str(FULL_B),
            "--policies", "dense,knorm,kvpop_mlp", "--checkpoints-dir", str(root / "ckpts"),
            "--analysis", "--analysis-n", "1", "--no-progress"]
    assert main(argv) == 0
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return out, rows, outputs


def test_reports_written(run):
    out, rows, _ = run
    for name in ("results.csv", "outputs.jsonl", "table1.md", "table2.md", "quality_vs_budget.png", "meta.json",
                 "recall_per_layer.csv", "recall_per_layer.png", "retention_heatmap.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith("kvpop-eval --model")
    assert "git_commit" in meta and meta["versions"]["torch"] == torch.__version__
    assert meta["seeds"]["base"] == 2 ** 48
    t1, t2 = (out / "table1.md").read_text(), (out / "table2.md").read_text()
    assert "EM reasoning" in t1 and "EM vt" not in t1
    assert all(f"EM {f}" in t2 for f in FAMILIES if f != "reasoning")
    assert not (out / "ablation_delay.md").exists()  # needs kvpop and kvpop_immediate


def test_one_row_per_policy_budget_family(run):
    _, rows, _ = run
    keys = [(r["policy"], r["budget"], r["family"]) for r in rows]
    assert len(keys) == len(set(keys))
    want = {("dense", "full", f) for f in FAMILIES}
    want |= {(p, str(b), f) for p in ("knorm", "kvpop_mlp") for b in (LENGTH // 2, FULL_B) for f in FAMILIES}
    assert set(keys) == want
    for r in rows:
        assert r["n"] == "2" and 0.0 <= float(r["token_acc"]) <= 1.0 and 0.0 <= float(r["em"]) <= 1.0
        # only reasoning traces copy fact values; the other families report no lookup accuracy
        if r["family"] == "reasoning":
            assert 0.0 <= float(r["lookup_acc"]) <= 1.0
        else:
            assert r["lookup_acc"] == "nan"


def test_full_budget_equals_dense(run):
    _, rows, outputs = run
    dense = {r["family"]: r for r in rows if r["policy"] == "dense"}
    assert sum(float(r["token_acc"]) for r in dense.values()) > 0  # the comparison is not vacuous
    for r in rows:
        if r["budget"] == str(FULL_B):
            d = dense[r["family"]]
            assert (r["em"], r["token_acc"], r["lookup_acc"]) == (d["em"], d["token_acc"], d["lookup_acc"]), r
    gen = {(o["policy"], str(o["budget"]), o["family"], o["seed"]): (o["generated"], o["token_acc"]) for o in outputs}
    for (p, b, f, s), v in gen.items():
        if b == str(FULL_B):
            assert v == gen[("dense", "full", f, s)]
    # a real budget does change something for some problem (generation or teacher-forced accuracy)
    assert any(v != gen[("dense", "full", f, s)] for (p, b, f, s), v in gen.items() if b == str(LENGTH // 2))


def test_recall_csv(run):
    out, _, _ = run
    with open(out / "recall_per_layer.csv") as fh:
        rec = list(csv.DictReader(fh))
    assert {(r["policy"], r["budget"], r["layer"], r["head"]) for r in rec} == {
        (p, str(b), str(layer), str(h)) for p in ("knorm", "kvpop_mlp") for b in (LENGTH // 2, FULL_B)
        for layer in (0, 1) for h in (0, 1)}
    for r in rec:
        x = float(r["oracle_recall"])
        assert math.isnan(x) if r["budget"] == str(FULL_B) else 0.0 <= x <= 1.0


@pytest.mark.parametrize("extra, match", [
    (["--policies", "dense,pyramidkv"], "Unknown policy"),
    (["--families", "reasoning,ruler"], "Unknown family"),
    (["--budgets", "36"], "no long-range"),
    (["--compression", "0.9"], "no long-range"),  # B = 30 <= 4 + 32
    (["--compression", "1.5"], r"must be in \(0, 1\)"),
    (["--compression", "abc"], "Bad --compression value"),
    (["--budgets", "abc"], "Bad --budgets value"),
    (["--budgets", "0.88"], "0.88 is a compression ratio: give it as --compression 0.88"),
    (["--budgets", "200,0.75"], "0.75 is a compression ratio: give it as --compression 0.75"),
    (["--compression", "256"], "256 is a token count, not a compression ratio: give it as --budgets 256"),
    (["--budgets", str(LENGTH // 2)], "Duplicate budget"),  # --compression 0.5 gives the same B
    (["--compression", "", "--budgets", ""], "No budget given"),
    (["--policies", "dense,kvpop"], "needs a scorer checkpoint"),
    (["--scorer-checkpoint", "knorm=/x"], "takes no checkpoint"),
    (["--prefill-chunk", "-1"], "--prefill-chunk >= 0"),
])
def test_bad_input_fails_before_model_work(tmp_path, extra, match):
    # the model path does not exist: any model work would raise OSError, not this ValueError
    argv = ["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--length", str(LENGTH),
            "--window", str(WINDOW), "--n", "1", "--compression", "0.5"] + extra
    with pytest.raises(ValueError, match=match):
        main(argv)
    assert not (tmp_path / "o").exists()


def test_budgets_and_checkpoint_lookup(tmp_path):
    shape = dict(length=2048, sinks=4, window=64)
    b256, = policies.parse_budgets(budgets="256", **shape)
    assert (b256.B, b256.topk, b256.tag, b256.cr) == (256, 188, "b256", 0.875)
    with pytest.raises(ValueError, match="Duplicate"):
        policies.parse_budgets(compression="0.75", budgets="512", **shape)
    b75, b88 = policies.parse_budgets(compression="0.75,0.88", **shape)
    assert (b75.B, b75.topk, b75.tag, b88.B, b88.tag) == (512, 444, "cr75", 246, "cr88")
    # both kinds at once: the ratios first, each kind keeps its tag; lists of numbers work as strings do
    both = policies.parse_budgets(compression=[0.88, 0.75], budgets=[300, 256], **shape)
    assert [(b.B, b.tag) for b in both] == [(246, "cr88"), (512, "cr75"), (300, "b300"), (256, "b256")]
    with pytest.raises(ValueError, match="give it as --compression 0.88"):
        policies.parse_budgets(budgets=[0.88], **shape)
    with pytest.raises(ValueError, match="give it as --budgets 512"):
        policies.parse_budgets(compression="512", **shape)
    with pytest.raises(ValueError, match="No budget given"):
        policies.parse_budgets(compression="", budgets=None, **shape)
    with pytest.raises(TypeError):  # the lists are keyword arguments: a bare "0.88" cannot be mistaken for either
        policies.parse_budgets("0.88", 2048, 4, 64)
    assert policies.parse_token_counts("256, 512") == [256, 512]
    with pytest.raises(ValueError, match="--budgets 0.5: 0.5 is a compression ratio"):
        policies.parse_token_counts("0.5")
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)
    for sub in ("kvpop_mlp_cr75", "kvpop_mlp", "kvpop_cr88", "kvpop_immediate_b246"):
        KVpopCache(cfg, sinks=4, window=64, topk=8, scorer="mlp" if "mlp" in sub else "mlstm",
                   scorer_kwargs={"delayed": False} if "immediate" in sub else None).save_pretrained(tmp_path / sub)
    assert policies.parse_checkpoint_specs(["kvpop_mlp@cr75=a", "kvpop=b", "kvpop=c@0.88", "kvpop_mlp=d@256"]) == {
        ("kvpop_mlp", "cr75"): "a", ("kvpop", None): "b", ("kvpop", "cr88"): "c", ("kvpop_mlp", "b256"): "d"}
    found = policies.scan_checkpoints_dir(tmp_path)
    assert set(found) == {("kvpop_mlp", "cr75"), ("kvpop_mlp", None), ("kvpop", "cr88"), ("kvpop_immediate", "b246")}
    assert policies.resolve_checkpoint(found, "kvpop_mlp", b75).endswith("kvpop_mlp_cr75")
    assert policies.resolve_checkpoint(found, "kvpop_mlp", b88).endswith("kvpop_mlp")
    assert policies.resolve_checkpoint(found, "kvpop", b75) is None
    assert policies.resolve_checkpoint(found, "kvpop_immediate", b88).endswith("kvpop_immediate_b246")
    with pytest.raises(ValueError, match="expects scorer='mlstm'"):
        policies.load_prototype("kvpop", str(tmp_path / "kvpop_mlp"))
    with pytest.raises(ValueError, match="delayed"):
        policies.load_prototype("kvpop", str(tmp_path / "kvpop_immediate_b246"))
    proto = policies.load_prototype("kvpop_mlp", str(tmp_path / "kvpop_mlp"))
    cache = policies.bind_factory("kvpop_mlp", proto)(cfg, 2, 8, 5)
    assert (cache.kvpop_config.sinks, cache.kvpop_config.window, cache.kvpop_config.topk) == (2, 8, 5)
    assert cache.scorer is proto.scorer


@pytest.mark.parametrize("flags, expected", [
    ([], [(512, "cr75"), (246, "cr88")]),  # kvpop-eval's default: --compression 0.75,0.88
    (["--budgets", "300"], [(300, "b300")]),  # token counts alone: the default ratios do not join them
    (["--compression", "0.75", "--budgets", "300,256"], [(512, "cr75"), (300, "b300"), (256, "b256")]),
])
def test_compression_and_budgets_combine_and_the_default_applies_alone(flags, expected):
    from kvpop_lab.testbed.budget_args import budgets_from_args

    args = build_parser().parse_args(["--model", "m", "--out", "o", "--length", "2048", "--window", "64", *flags])
    assert [(b.B, b.tag) for b in budgets_from_args(args, args.length, args.sinks, args.window)] == expected


def test_registered_policy_plugs_in(tmp_path):
    calls = []

    def tova_like(model_config, sinks, window, topk, checkpoint=None):
        calls.append((sinks, window, topk))
        return KVpopCache(model_config, sinks=sinks, window=window, topk=topk, scorer="knorm")

    policies.register_policy("test_plugin", tova_like)
    try:
        args = build_parser().parse_args(["--model", "m", "--out", str(tmp_path), "--policies", "dense,test_plugin",
                                          "--families", "vt", "--n", "1", "--length", "200", "--window", "16",
                                          "--compression", "0.5"])
        plan = plan_from_args(args)
        assert [(r.policy, r.budget and r.budget.B) for r in plan.runs] == [("dense", None), ("test_plugin", 100)]
        cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        assert plan.runs[0].factory()(cfg) is None
        assert isinstance(plan.runs[1].factory()(cfg), KVpopCache) and calls == [(4, 16, 80)]
    finally:
        policies.POLICIES.pop("test_plugin")


def test_attention_based_policies_in_the_eval():
    """TOVA's teacher-forced accuracy: the prompt as one chunk, then the target token by token (a full budget
    gives dense accuracy); the recall analysis skips it (no static priority)."""
    from kvpop_lab.testbed.evaluate import token_accuracy

    tok = build_tokenizer()
    model = _tiny_trained_model(tok, steps=20)
    model.set_attn_implementation("kvpop")  # as kvpop-eval loads it; TOVA's scores come from it
    problems = [make_problem("reasoning", length=200, seed=s) for s in range(2)]
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: calls.append(args[0].shape[1]),
                                           with_kwargs=True)
    try:
        full = token_accuracy(model, tok, problems, lambda: policies.POLICIES["tova"].factory(model.config, 4, 8, 900),
                              progress=False)
    finally:
        hook.remove()
    dense = token_accuracy(model, tok, problems, None, progress=False)
    assert full["per_problem"] == dense["per_problem"] and dense["acc"]["all"] > 0
    ex = training_example(problems[0], tok, mode="trace")
    first = next(i for i, x in enumerate(ex["labels"]) if x != -100)
    assert calls[: len(ex["input_ids"]) - first + 1] == [first] + [1] * (len(ex["input_ids"]) - first)
    tova = policies.POLICIES["tova"].factory(model.config, 4, 8, 40)
    assert analysis.oracle_recall_rows(model, tok, problems[:1], [("tova", None, tova)], progress=False) == []


def test_oracle_topk_recall_bounds():
    g = torch.Generator().manual_seed(0)
    oracle = torch.randn(3, 64, generator=g)
    assert torch.allclose(analysis.oracle_topk_recall(oracle, oracle, 2, 4, 8), torch.ones(3, dtype=torch.float64))
    r = analysis.oracle_topk_recall(-oracle, oracle, 2, 4, 8)
    assert ((r >= 0) & (r < 1)).all()
    assert torch.isnan(analysis.oracle_topk_recall(oracle, oracle, 2, 4, 64)).all()  # never evicts


def _recall_by_hand(prio, oracle, sinks, window, topk, m, mass):
    """Per query: the eligible tokens (sinks <= t <= q - window), each side's best by value; mean over the
    queries with more than topk eligible."""
    H, S = oracle.shape
    out = []
    for h in range(H):
        vals = []
        for q in range(S):
            elig = list(range(sinks, q - window + 1))
            if len(elig) <= topk:
                continue
            kept = set(sorted(elig, key=lambda t: -prio[h, t].item())[:topk])
            best = sorted(elig, key=lambda t: -oracle[h, t].item())[:m]
            w = {t: (oracle[h, t].exp().item() if mass else 1.0) for t in best}
            vals.append(sum(w[t] for t in best if t in kept) / sum(w.values()))
        out.append(sum(vals) / len(vals))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("m,mass", [(None, False), (3, False), (None, True)])
def test_oracle_topk_recall_matches_a_count_by_hand(m, mass):
    """The running-top-k recall == recounting every query's kept sets from scratch (random priorities)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        prio, oracle = torch.randn(2, 40, generator=g), torch.randn(2, 40, generator=g)
        got = analysis.oracle_topk_recall(prio, oracle, 2, 4, 8, chunk=16, oracle_k=m, mass=mass)
        torch.testing.assert_close(got, _recall_by_hand(prio, oracle, 2, 4, 8, 8 if m is None else m, mass))


def test_oracle_recall_shares_in_one_pass_equal_the_single_measures():
    g = torch.Generator().manual_seed(2)
    prio, oracle = torch.randn(3, 60, generator=g), torch.randn(3, 60, generator=g)
    shares = [(8, False), (3, False), (16, False), (8, True), (3, True)]
    got = analysis.oracle_recall_shares(prio, oracle, 2, 4, 8, shares, chunk=16)
    assert got.shape == (5, 3)
    for row, (k, mass) in zip(got, shares):
        torch.testing.assert_close(row, analysis.oracle_topk_recall(prio, oracle, 2, 4, 8, oracle_k=k, mass=mass))


def test_ablation_table():
    rows = [{"policy": p, "budget": 100, "cr": 0.5, "family": f, "em": em, "token_acc": acc}
            for p, em, acc in (("kvpop", 0.5, 0.8), ("kvpop_immediate", 0.25, 0.6)) for f in ("reasoning", "vt")]
    md = analysis.ablation_delay(rows)
    assert "| 100 | 0.500 | 0.500 | 0.250 | 0.800 | 0.600 | +0.200 |" in md
    assert analysis.ablation_delay([r for r in rows if r["policy"] == "kvpop"]) is None


def test_fact_lookup_mask_marks_exactly_the_copied_fact_values():
    from kvpop_lab.testbed import build_tokenizer, make_problem, training_example
    from kvpop_lab.testbed.evaluate import _fact_lookup_mask

    tok = build_tokenizer()
    p = make_problem("reasoning", length=512, seed=3)
    ids = torch.tensor(training_example(p, tok)["input_ids"])
    mask = _fact_lookup_mask(p, ids, tok)
    # position i predicts ids[i + 1]: each marked target must be the value of the fact named two tokens back
    marked = mask.nonzero().flatten().tolist()
    for i in marked:
        name = tok.convert_ids_to_tokens(int(ids[i - 1]))
        assert tok.convert_ids_to_tokens(int(ids[i])) == "="
        assert tok.convert_ids_to_tokens(int(ids[i + 1])) == str(p.meta["facts"][name])
    # every fact line of the prompt and every fact operand restated in the trace is marked
    n_trace = sum(1 for _, operands, _ in p.meta["rules"] for o in operands if o in p.meta["facts"])
    assert len(marked) == len(p.meta["facts"]) + n_trace
    assert _fact_lookup_mask(make_problem("vt", length=512, seed=3), ids, tok).sum() == 0


def test_distilled_students_get_recall_rows_from_their_own_keys(run, tmp_path):
    """A policy with its own weights ranks its own model's keys and values against --model's oracle: a student
    identical to the model gives the model's recall; a student with other key projections gives other values."""
    import copy
    import types

    out, _, _ = run
    root = out.parent
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    scorer_ck = KVpopCache.from_pretrained(root / "ckpts" / "kvpop_mlp", model.config)
    problems = [make_problem("reasoning", length=LENGTH, seed=2 ** 48)]
    budget = types.SimpleNamespace(B=LENGTH // 2, cr=0.5)
    cache = KVpopCache(model.config, sinks=SINKS, window=WINDOW, topk=LENGTH // 2 - SINKS - WINDOW, scorer="mlp")
    cache.scorer.load_state_dict(scorer_ck.scorer.state_dict())
    alone = analysis.oracle_recall_rows(model, tok, problems, [("p", budget, cache)], progress=False)
    twin = analysis.oracle_recall_rows(model, tok, problems, [("p", budget, cache, copy.deepcopy(model))],
                                       progress=False)
    assert [r["oracle_recall"] for r in twin] == [r["oracle_recall"] for r in alone]

    student = copy.deepcopy(model)
    with torch.no_grad():
        for layer in student.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.0).add_(0.5 * torch.randn_like(layer.self_attn.k_proj.weight))
    student.save_pretrained(tmp_path / "student")
    tok.save_pretrained(tmp_path / "student")
    scorer_ck.save_pretrained(tmp_path / "student")
    argv = ["--model", str(root / "model"), "--out", str(tmp_path / "out"), "--n", "1", "--length", str(LENGTH),
            "--sinks", str(SINKS), "--window", str(WINDOW), "--compression", "0.5", "--families", "reasoning",
            "--policies", "kvpop_mlp,kvpop_mlp_distill", "--checkpoints-dir", str(root / "ckpts"),
            "--scorer-checkpoint", f"kvpop_mlp_distill={tmp_path / 'student'}", "--skip-em",
            "--analysis", "--analysis-n", "1", "--no-progress"]
    assert main(argv) == 0
    with open(tmp_path / "out" / "recall_per_layer.csv") as fh:
        rec = {(r["policy"], r["layer"], r["head"]): float(r["oracle_recall"]) for r in csv.DictReader(fh)}
    keys = [(str(layer), str(h)) for layer in (0, 1) for h in (0, 1)]
    assert all(0.0 <= rec[("kvpop_mlp_distill",) + k] <= 1.0 for k in keys)
    assert any(rec[("kvpop_mlp_distill",) + k] != rec[("kvpop_mlp",) + k] for k in keys)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["analysis"]["heatmap"]["policy"] == "kvpop_mlp_distill"  # no EM (--skip-em): by preference


def test_a_student_is_loaded_once_for_all_its_budgets_and_the_analysis(run, tmp_path, monkeypatch):
    """kvpop-eval loads a policy's own weights once: its runs at several budgets and --analysis reuse them."""
    import kvpop_lab.testbed.models as models

    out, _, _ = run
    root = out.parent
    student = tmp_path / "student"
    AutoModelForCausalLM.from_pretrained(root / "model").save_pretrained(student)
    build_tokenizer().save_pretrained(student)
    KVpopCache.from_pretrained(root / "ckpts" / "kvpop_mlp").save_pretrained(student)
    loads = []
    real = models.load_model

    def counting(path, *a, **k):
        loads.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(models, "load_model", counting)
    monkeypatch.setattr(analysis, "load_model", counting)
    argv = ["--model", str(root / "model"), "--out", str(tmp_path / "out"), "--n", "1", "--length", str(LENGTH),
            "--sinks", str(SINKS), "--window", str(WINDOW), "--compression", "0.5,0.75", "--families", "reasoning",
            "--policies", "kvpop_mlp_distill", "--scorer-checkpoint", f"kvpop_mlp_distill={student}", "--skip-em",
            "--analysis", "--analysis-n", "1", "--no-progress"]
    assert main(argv) == 0
    assert loads.count(str(student)) == 1
    with open(tmp_path / "out" / "results.csv") as fh:
        assert sorted(r["cr"] for r in csv.DictReader(fh) if r["policy"] == "kvpop_mlp_distill") == ["0.5", "0.75"]


def test_heatmap_shows_the_best_policy_at_the_highest_compression():
    import types

    def run(policy, B, cr):
        return types.SimpleNamespace(policy=policy, budget=types.SimpleNamespace(B=B, cr=cr))

    runs = [run("kvpop", 100, 0.5), run("kvpop_mlp", 100, 0.5), run("streaming", 100, 0.5), run("kvpop", 150, 0.25)]
    rows = [{"policy": "kvpop", "budget": 100, "family": "reasoning", "em": 0.2},
            {"policy": "kvpop_mlp", "budget": 100, "family": "reasoning", "em": 0.6},
            {"policy": "kvpop", "budget": 150, "family": "reasoning", "em": 0.9},
            {"policy": "streaming", "budget": 100, "family": "mk_niah", "em": 1.0}]
    assert analysis.heatmap_run(runs, rows).policy == "kvpop_mlp"
    assert analysis.heatmap_run(runs, None).policy == "kvpop"  # preference order without rows
    assert analysis.heatmap_run(runs, [dict(r, em=float("nan")) for r in rows]).policy == "kvpop"


def test_oracle_decay_ranks_the_oracle_with_each_policys_own_decay(run):
    """``oracle_decay=True``: a policy without a decay gets the same rows as without the option; with a decay that
    outweighs every score, student and oracle both keep the most recent eligible tokens, so the recall is 1 (while
    the undecayed oracle is not recency-ordered and gives less); asking for the attention share as well is refused."""
    import types

    out, _, _ = run
    root = out.parent
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    problems = [make_problem("reasoning", length=LENGTH, seed=2 ** 48)]
    budget = types.SimpleNamespace(B=LENGTH // 4, cr=0.75)
    over = dict(sinks=SINKS, window=WINDOW, topk=LENGTH // 4 - SINKS - WINDOW, scorer="knorm")
    plain = KVpopCache(model.config, **over)
    rows = [analysis.oracle_recall_rows(model, tok, problems, [("p", budget, plain)], progress=False, oracle_decay=d)
            for d in (False, True)]
    assert [r["oracle_recall"] for r in rows[0]] == [r["oracle_recall"] for r in rows[1]]

    steep = KVpopCache(model.config, log_gamma=-1e4, decay_step=1, **over)
    decayed = analysis.oracle_recall_rows(model, tok, problems, [("p", budget, steep)], progress=False,
                                          oracle_decay=True)
    undecayed = analysis.oracle_recall_rows(model, tok, problems, [("p", budget, steep)], progress=False)
    assert all(r["oracle_recall"] == pytest.approx(1.0) for r in decayed)
    assert sum(r["oracle_recall"] for r in undecayed) / len(undecayed) < 0.9
    with pytest.raises(ValueError, match="oracle_decay"):
        analysis.oracle_recall_rows(model, tok, problems, [("p", budget, steep)], progress=False, mass=True,
                                    oracle_decay=True)


def test_without_matplotlib_the_tables_are_written_and_figures_skipped(run, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    model_dir, out = run[0].parent / "model", tmp_path / "out"
    argv = ["--model", str(model_dir), "--out", str(out), "--n", "1", "--length", str(LENGTH), "--sinks", str(SINKS),
            "--window", str(WINDOW), "--compression", "0.5", "--policies", "dense,knorm", "--no-progress"]
    assert main(argv) == 0
    for name in ("results.csv", "table1.md", "table2.md", "meta.json"):
        assert (out / name).is_file(), name
    assert not (out / "quality_vs_budget.png").exists()
    assert "matplotlib is not installed, so the figure" in capsys.readouterr().err
