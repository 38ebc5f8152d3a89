"""The lm-evaluation-harness model ``kvpop`` (kvpop_hf/integrations/lm_eval.py), the task exporter
(benchmarks/kvpop_lab/testbed/lm_eval_tasks.py) and the table command, with lm-eval from the package registry, on a tiny
random Qwen3 with the testbed tokenizer (CPU, offline)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from kvpop_hf import KVpopCache  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_lab.testbed import build_tokenizer  # noqa: E402
from kvpop_hf.policies import POLICIES  # noqa: E402

from helpers import tiny_model  # noqa: E402

pytestmark = pytest.mark.tier("unit")

SINKS, WINDOW, TOPK = 2, 8, 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Qwen3 (vocab of the testbed tokenizer) saved with that tokenizer."""
    tok = build_tokenizer()
    model = tiny_model("qwen3", attn="sdpa", layers=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tasks_dir(tiny_dir, tmp_path_factory):
    from kvpop_lab.testbed.lm_eval_tasks import export_tasks

    d = tmp_path_factory.mktemp("tasks")
    export_tasks(d, str(tiny_dir), ["vt", "niah_single"], [160], n=3)
    export_tasks(d, str(tiny_dir), ["niah_multikey"], [128], n=2, repeats=3, temperature=1.0, group="sampled")
    return d


def _lm(tiny_dir, **args):
    from kvpop_hf.integrations.lm_eval import KVpopLM

    return KVpopLM(pretrained=str(tiny_dir), device="cpu", dtype="float32", **args)


def _hf(tiny_dir, **args):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_dir), device="cpu", dtype="float32", **args)


def _gen_requests(prompts, max_gen_toks=6, **gen):
    return [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": max_gen_toks, "do_sample": False, **gen}),
                     i) for i, p in enumerate(prompts)]


def _ll_requests(pairs):
    return [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(pairs)]


PROMPTS = ["memorize the variable assignments below .\n" + " ".join(["kages stustol grele pluwistas"] * n)
           + "\nVAR a = 12345 ." for n in (9, 3, 6, 12)]
LL_PAIRS = [(PROMPTS[0], " 1 2 3"), (PROMPTS[0], " 4"), (PROMPTS[1], " kages stustol"), (PROMPTS[3], " 9 9")]


# -- the command line -------------------------------------------------------------------------------
@pytest.mark.tier("scripts")  # another process or the command line
def test_cli_runs_kvpop_on_an_exported_task_and_the_table_reads_it(tiny_dir, tasks_dir, tmp_path, monkeypatch):
    from kvpop_hf.integrations.lm_eval import main
    from kvpop_hf.integrations.lm_eval_table import main as table_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = []
    for name, model, args in (("dense", "hf", ""), ("knorm", "kvpop", f",policy=knorm,sinks=2,window=8,topk={TOPK}"),
                              ("streaming", "kvpop", ",policy=streaming,window=8,compression=0.5")):
        out = tmp_path / name
        monkeypatch.setattr(sys, "argv", ["kvpop-lm-eval"])
        main(["run", "--model", model, "--model_args", f"pretrained={tiny_dir},dtype=float32{args}",
              "--tasks", "kvpop_vt_160", "--include_path", str(tasks_dir), "--device", "cpu", "--batch_size", "2",
              "--output_path", str(out), "--log_samples"])
        res = json.loads(next(out.rglob("results_*.json")).read_text())
        assert res["config"]["model"] == model
        assert "exact_match,rollouts" in res["results"]["kvpop_vt_160"]
        samples = [json.loads(x) for x in next(out.rglob("samples_kvpop_vt_160_*.jsonl")).read_text().splitlines()]
        assert len(samples) == 3 and all(isinstance(s["resps"][0][0], str) for s in samples)
        runs.append(out)
    assert table_main([*map(str, runs), "--out", str(tmp_path / "table"), "--length", "160"]) == 0
    md = (tmp_path / "table" / "table.md").read_text()
    assert "| dense | full |" in md and "| knorm | 18 |" in md and "| streaming | cr50 |" in md
    assert (tmp_path / "table" / "quality_vs_budget.png").stat().st_size > 0
    csv = (tmp_path / "table" / "table.csv").read_text().splitlines()
    assert len(csv) == 4 and csv[0].startswith("policy,budget,cr")


@pytest.mark.tier("scripts")  # the command line
def test_cli_generate_until_continuous_and_static_give_the_same_samples(tiny_dir, tasks_dir, tmp_path, monkeypatch):
    """kvpop-lm-eval with the same arguments as before (the default: generate_until through generate_batch, here with
    max_rows=2) and with batching=static: the same answer for every problem of an exported task."""
    from kvpop_hf.integrations.lm_eval import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    answers = {}
    for name, extra in (("continuous", ",max_rows=2"), ("static", ",batching=static")):
        out = tmp_path / name
        monkeypatch.setattr(sys, "argv", ["kvpop-lm-eval"])
        main(["run", "--model", "kvpop", "--model_args", f"pretrained={tiny_dir},dtype=float32,policy=knorm,sinks=2,"
              f"window=8,topk={TOPK}{extra}", "--tasks", "kvpop_vt_160", "--include_path", str(tasks_dir),
              "--device", "cpu", "--batch_size", "3", "--output_path", str(out), "--log_samples"])
        samples = [json.loads(x) for x in next(out.rglob("samples_kvpop_vt_160_*.jsonl")).read_text().splitlines()]
        answers[name] = {s["doc"]["seed"]: s["resps"][0][0] for s in samples}
        res = json.loads(next(out.rglob("results_*.json")).read_text())
        assert res["config"]["model_args"]["batching" if name == "static" else "max_rows"] in ("static", 2)
    assert len(answers["static"]) == 3 and answers["continuous"] == answers["static"]


@pytest.mark.tier("scripts")  # another process or the command line
def test_console_command_is_lm_evals_cli(tiny_dir):
    """The console command's function hands its arguments to lm-eval's own command line unchanged."""
    out = subprocess.run([sys.executable, "-c", "from kvpop_hf.integrations.lm_eval import main; main()", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "run" in out.stdout and "lm-eval" in out.stdout


def test_library_imports_without_lm_eval():
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "import kvpop_hf, kvpop_hf.integrations, kvpop_hf.integrations.policy_args, kvpop_lab.testbed.lm_eval_tasks\n"
            "try:\n import kvpop_hf.integrations.lm_eval\nexcept ImportError: print('needs lm_eval')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "needs lm_eval"


def test_simple_evaluate_after_import_registers_the_model(tiny_dir, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvpop_hf.integrations.lm_eval  # noqa: F401

    res = lm_eval.simple_evaluate(model="kvpop", model_args=f"pretrained={tiny_dir},dtype=float32,policy=snapkv,"
                                  f"sinks=2,window=8,topk={TOPK}", tasks=["kvpop_niah_single_160"], device="cpu",
                                  task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=False)
    assert 0.0 <= res["results"]["kvpop_niah_single_160"]["exact_match,rollouts"] <= 1.0


# -- generation -------------------------------------------------------------------------------------
def test_dense_policy_equals_the_hf_model(tiny_dir):
    reqs = _gen_requests(PROMPTS, max_gen_toks=8)
    ours = _lm(tiny_dir, policy="dense", batch_size=2)
    assert ours.model.config._attn_implementation == _hf(tiny_dir).model.config._attn_implementation
    assert ours.generate_until(reqs) == _hf(tiny_dir, batch_size=2).generate_until(reqs)
    pairs = _ll_requests(LL_PAIRS)
    assert ours.loglikelihood(pairs) == _hf(tiny_dir, batch_size=2).loglikelihood(pairs)


@pytest.mark.parametrize("args", [dict(policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK),
                                  dict(policy="snapkv", sinks=SINKS, window=WINDOW, topk=TOPK),
                                  dict(policy="knorm", sinks=SINKS, window=WINDOW, compression=0.6)])
def test_batched_left_padded_generation_equals_one_by_one(tiny_dir, args):
    """Rows of different lengths in one batch (left padding; with compression= rows of different budgets are
    grouped) give what each row gives alone, and differ from dense (the cache evicts)."""
    reqs = _gen_requests(PROMPTS, max_gen_toks=8)
    batched = _lm(tiny_dir, batch_size=4, **args).generate_until(reqs)
    single = _lm(tiny_dir, batch_size=1, **args)
    assert batched == single.generate_until(reqs)
    assert len(set(batched)) > 1


def _mixed_requests():
    """Requests of different lengths, ``until`` strings and ``max_gen_toks`` (greedy); "a" and "e" cut most
    generations of the tiny model early, "zz" none."""
    kinds = [dict(until=[], max_gen_toks=8), dict(until=["e"], max_gen_toks=12), dict(until=["zz", "a"], max_gen_toks=5),
             dict(until="\n", max_gen_toks=3)]
    args = [(p, {**k, "do_sample": False}) for i, p in enumerate(PROMPTS) for k in kinds[i % 2:] + kinds[:i % 2]]
    return [Instance("generate_until", {}, a, i) for i, a in enumerate(args)]


def _spy_generate_batch(monkeypatch):
    """Record every ``generate_batch`` call's requests and ``max_rows``; count the prompts it prefills."""
    import kvpop_hf.batch

    calls, prefills = [], []
    batch, prefill = kvpop_hf.batch.generate_batch, kvpop_hf.batch._prefill
    monkeypatch.setattr(kvpop_hf.batch, "generate_batch",
                        lambda model, inputs, *a, **kw: calls.append((list(inputs), kw["max_rows"])) or batch(
                            model, inputs, *a, **kw))
    monkeypatch.setattr(kvpop_hf.batch, "_prefill", lambda *a, **kw: prefills.append(1) or prefill(*a, **kw))
    return calls, prefills


@pytest.mark.parametrize("args", [dict(policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK),
                                  dict(policy="streaming", sinks=SINKS, window=WINDOW, topk=TOPK),
                                  dict(policy="knorm", sinks=SINKS, window=WINDOW, compression=0.6)])
def test_generate_until_through_generate_batch_equals_static_batches(tiny_dir, args, monkeypatch):
    """The default path: all requests (4 lengths x 4 settings of until and max_gen_toks, greedy) through the rows of
    one KVpopCache (one per budget with compression=), as many rows as the batch size; the texts equal lm-eval's
    static batches through model.generate (batching=static), request by request, and come in the input order."""
    reqs = _mixed_requests()
    static = _lm(tiny_dir, batch_size=3, batching="static", **args)
    assert not static.continuous
    want = static.generate_until(reqs)
    calls, prefills = _spy_generate_batch(monkeypatch)
    lm = _lm(tiny_dir, batch_size=3, **args)
    assert lm.continuous and lm.batching == "continuous"
    monkeypatch.setattr(lm.model, "generate", lambda *a, **kw: pytest.fail("model.generate called"))
    got = lm.generate_until(reqs)
    assert got == want
    assert len(prefills) == len(reqs) and sum(len(c[0]) for c in calls) == len(reqs)
    eos = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)  # HFLM adds it to every until
    assert {(r.max_new_tokens, tuple(r.stop_strings)) for c, _ in calls for r in c} == {
        (8, (eos,)), (12, ("e", eos)), (5, ("zz", "a", eos)), (3, ("\n", eos))}
    budgets = len({lm.kv.budget(len(lm.tok_encode(p))) for p in PROMPTS})
    assert len(calls) == budgets and (budgets == 1) == ("topk" in args)
    if "topk" in args:
        assert calls[0][1] == 3  # rows recycled across the 16 requests
        lens = [len(r.input_ids) for r in calls[0][0]]
        assert lens == sorted(lens, reverse=True)  # longest first, as HFLM orders them
    free = {r.args[0]: t for r, t in zip(reqs, got) if r.args[1]["until"] == []}
    cut = [(r.args[0], t) for r, t in zip(reqs, got) if r.args[1]["until"] == ["e"]]  # cut before the first "e"
    assert all("e" not in t and free[p].startswith(t) for p, t in cut) and any(len(t) < len(free[p]) for p, t in cut)
    # the output order is the input order: the same requests shuffled give the same texts shuffled
    order = torch.randperm(len(reqs), generator=torch.Generator().manual_seed(0)).tolist()
    assert lm.generate_until([reqs[i] for i in order]) == [want[i] for i in order]


def test_repeats_are_one_prompt_greedy_shared_sampled_forked(tiny_dir, monkeypatch):
    """lm-eval's ``repeats`` (the same Instance n times in the list): greedy, one sequence given to all n (equal to
    the static path's n rows); sampled, one prefill forked into n rows (num_return_sequences=n), n samples that
    differ and repeat under the same torch seed."""
    calls, prefills = _spy_generate_batch(monkeypatch)
    lm = _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK, batch_size=4)
    one, other = _gen_requests(PROMPTS[:2], max_gen_toks=6, until=["zz"])
    greedy = [one] * 3 + [other] + [one] * 2
    got = lm.generate_until(greedy)
    assert len(prefills) == 2 and [r.num_return_sequences for r in calls[0][0]] == [1, 1]
    assert got == _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK, batch_size=4,
                      batching="static").generate_until(greedy)
    assert len(set(got[:3] + got[4:])) == 1 and got[3] != got[0]
    calls.clear(), prefills.clear()
    sampled, = _gen_requests(PROMPTS[:1], max_gen_toks=8, do_sample=True, temperature=1.0)
    torch.manual_seed(0)
    texts = lm.generate_until([sampled] * 5 + [other])
    assert len(prefills) == 2 and [r.num_return_sequences for r in calls[0][0]] == [5, 1]
    assert calls[0][1] == 4  # five samples through four rows: the fifth waits for a free row
    assert len(set(texts[:5])) > 1 and texts[5] == got[3]
    torch.manual_seed(0)
    assert lm.generate_until([sampled] * 5 + [other]) == texts


def test_generate_until_stays_static_where_generate_batch_cannot_serve(tiny_dir, monkeypatch):
    """Policies generate_batch does not serve (attention-scored, DMS, dense) keep lm-eval's static batches; so do
    requests with a setting it does not implement (repetition_penalty here), beside the others in the batch."""
    calls, _ = _spy_generate_batch(monkeypatch)
    snap = _lm(tiny_dir, policy="snapkv", sinks=SINKS, window=WINDOW, topk=TOPK, batch_size=2)
    assert not snap.continuous and "re-scores its entries every step" in snap._static_reason
    snap.generate_until(_gen_requests(PROMPTS[:2], max_gen_toks=2))
    assert not calls
    assert not _lm(tiny_dir, policy="dense").continuous
    lm = _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK, batch_size=2, max_rows=3)
    reqs = _gen_requests(PROMPTS[:2], max_gen_toks=4) + _gen_requests(PROMPTS[2:], max_gen_toks=4, repetition_penalty=1.3)
    got = lm.generate_until(reqs)
    assert [len(c[0]) for c in calls] == [2] and calls[0][1] == 2  # two requests: two rows of max_rows=3
    static = _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK, batch_size=2, batching="static")
    assert got == static.generate_until(reqs)


def test_generation_evicts_like_a_kvpop_cache_in_generate(tiny_dir):
    """The text equals ``model.generate`` with a fresh KVpopCache of the same budget (greedy)."""
    lm = _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK)
    out = lm.generate_until(_gen_requests(PROMPTS[:1], max_gen_toks=10))[0]
    tok, model = lm.tokenizer, lm.model
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    cache = KVpopCache(model.config, sinks=SINKS, window=WINDOW, topk=TOPK, scorer="knorm")
    ref = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=tok.pad_token_id,
                         **with_cache(model, cache))
    assert cache.get_seq_length() > SINKS + WINDOW + TOPK
    assert out == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).split(tok.eos_token)[0]


def test_pass_at_k_with_repeats_on_a_sampled_task(tiny_dir, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvpop_hf.integrations.lm_eval  # noqa: F401
    from kvpop_lab.testbed.lm_eval_tasks import process_results

    res = lm_eval.simple_evaluate(model="kvpop", model_args=f"pretrained={tiny_dir},dtype=float32,policy=streaming,"
                                  f"sinks=2,window=8,topk={TOPK}", tasks=["sampled_niah_multikey_128"], device="cpu",
                                  task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                                  batch_size=3, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = res["samples"]["sampled_niah_multikey_128"]
    assert len(samples) == 2
    em, pk = [], []
    for s in samples:
        rollouts = s["filtered_resps"][0]
        assert isinstance(rollouts, list) and len(rollouts) == 3
        assert len(set(rollouts)) > 1  # sampled, not greedy
        r = process_results(s["doc"], [rollouts])
        em.append(r["exact_match"])
        pk.append(r["pass_at_k"])
    out = res["results"]["sampled_niah_multikey_128"]
    assert math.isclose(out["exact_match,rollouts"], sum(em) / 2) and math.isclose(out["pass_at_k,rollouts"], sum(pk) / 2)


def test_process_results_is_kvpop_evals_exact_match():
    from kvpop_lab.testbed.lm_eval_tasks import process_results

    doc = {"answer": "12345"}
    assert process_results(doc, [" 12345\nmore"]) == {"exact_match": 1.0, "pass_at_k": 1.0}
    assert process_results(doc, ["y1 = 3 .\nanswer : 12345"])["exact_match"] == 1.0
    assert process_results(doc, [["1234", " 12345", "x"]]) == {"exact_match": pytest.approx(1 / 3), "pass_at_k": 1.0}
    assert process_results(doc, [["1234", "x"]]) == {"exact_match": 0.0, "pass_at_k": 0.0}


# -- loglikelihood ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["knorm", "snapkv", "streaming"])
def test_loglikelihood_equals_dense_when_the_budget_covers_the_context(tiny_dir, policy):
    pairs = _ll_requests(LL_PAIRS)
    dense = _hf(tiny_dir, batch_size=2).loglikelihood(pairs)
    ours = _lm(tiny_dir, policy=policy, sinks=SINKS, window=WINDOW, topk=4096).loglikelihood(pairs)
    for (a, ga), (b, gb) in zip(dense, ours):
        assert b == pytest.approx(a, abs=1e-4) and ga == gb


@pytest.mark.parametrize("policy", ["knorm", "snapkv"])
def test_loglikelihood_evicts_the_context_as_generation_does(tiny_dir, policy):
    """The loglikelihood of the greedy continuation equals the sum of ``generate``'s own log-probabilities with
    the same cache (prompt prefilled in one forward, then token by token), and differs from dense."""
    lm = _lm(tiny_dir, policy=policy, sinks=SINKS, window=WINDOW, topk=TOPK)
    tok, model = lm.tokenizer, lm.model
    ids = tok(PROMPTS[3], return_tensors="pt").input_ids
    cache = lm.kv.make_cache(ids.shape[1])
    out = model.generate(ids, do_sample=False, max_new_tokens=5, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id, **with_cache(model, cache))
    cont = out.sequences[0, ids.shape[1]:].tolist()
    ref = sum(torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, cont))
    got = lm._loglikelihood_tokens([(None, ids[0].tolist(), cont)], disable_tqdm=True)[0]
    assert got[0] == pytest.approx(ref, abs=1e-4) and got[1]
    dense = _hf(tiny_dir)._loglikelihood_tokens([(None, ids[0].tolist(), cont)], disable_tqdm=True)[0]
    assert abs(dense[0] - got[0]) > 1e-3


@pytest.mark.parametrize("policy", ["streaming", "random"])
def test_prefill_chunks_change_nothing(tiny_dir, policy):
    """prefill_chunk=N changes neither loglikelihoods nor generations for static priorities (the prompts repeat
    words, so K-Norm would tie on equal key norms and float noise would pick; these policies have no ties)."""
    pairs = _ll_requests(LL_PAIRS)
    args = dict(policy=policy, sinks=SINKS, window=WINDOW, topk=TOPK)
    whole_lm, chunked_lm = _lm(tiny_dir, batch_size=4, **args), _lm(tiny_dir, batch_size=4, prefill_chunk=16, **args)
    reqs = _gen_requests(PROMPTS, max_gen_toks=8)
    assert chunked_lm.generate_until(reqs) == whole_lm.generate_until(reqs)
    whole, chunked = whole_lm.loglikelihood(pairs), chunked_lm.loglikelihood(pairs)
    for (a, _), (b, _) in zip(whole, chunked):
        assert b == pytest.approx(a, abs=1e-4)


# -- every policy; bad model_args -------------------------------------------------------------------
def _checkpoint(policy, tiny_dir, root: Path) -> str:
    """A checkpoint folder that ``policy`` accepts: random scorer weights of the expected kind (the model folder
    with it for policies that bring their own weights)."""
    from transformers import AutoConfig

    pol = POLICIES[policy]
    d = root / policy
    config = AutoConfig.from_pretrained(tiny_dir)
    if policy == "dms":
        from kvpop_hf.baselines.dms import DMSCache

        DMSCache(config, sinks=SINKS, window=WINDOW).save_pretrained(d)
    else:
        kw = {k: v for k, v in pol.expect.items() if k != "scorer"}
        KVpopCache(config, sinks=SINKS, window=WINDOW, topk=TOPK, scorer=pol.expect.get("scorer", "mlstm"),
                   scorer_kwargs=kw or None).save_pretrained(d)
    if pol.own_model:
        import shutil

        for f in Path(tiny_dir).iterdir():
            shutil.copy(f, d / f.name)
    return str(d)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_name_is_accepted(tiny_dir, tmp_path, policy):
    pol = POLICIES[policy]
    args = dict(policy=policy)
    pretrained = tiny_dir
    if pol.needs_checkpoint:
        path = _checkpoint(policy, tiny_dir, tmp_path)
        if pol.own_model:
            pretrained = path
        else:
            args["scorer"] = path
    if not pol.dense and policy != "dms":
        args.update(sinks=SINKS, window=WINDOW, topk=TOPK)
    from kvpop_hf.integrations.lm_eval import KVpopLM

    lm = KVpopLM(pretrained=str(pretrained), device="cpu", dtype="float32", batch_size=2, **args)
    text = lm.generate_until(_gen_requests(PROMPTS[:2], max_gen_toks=3))
    assert len(text) == 2 and all(isinstance(t, str) for t in text)
    (ll, _), = lm.loglikelihood(_ll_requests(LL_PAIRS[:1]))
    assert math.isfinite(ll) and ll < 0
    if not pol.dense:
        assert lm.kv.make_cache(100) is not None and lm.kv.make_cache(100) is not lm.kv.make_cache(100)


@pytest.fixture()
def config_only(tiny_dir, tmp_path):
    """The model folder without weights: an argument error must come before the weights are read."""
    import shutil

    d = tmp_path / "no_weights"
    d.mkdir()
    for f in Path(tiny_dir).iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, d / f.name)
    return d


def test_bad_model_args_fail_before_the_weights_load(config_only, tiny_dir, tmp_path):
    from transformers import AutoConfig

    from kvpop_hf.integrations.lm_eval import KVpopLM

    other = AutoConfig.from_pretrained(tiny_dir)
    other.num_key_value_heads, other.num_attention_heads = 1, 2
    KVpopCache(other, sinks=SINKS, window=WINDOW, topk=TOPK, scorer="mlstm",
               scorer_kwargs={"delayed": True}).save_pretrained(tmp_path / "wrong_shape")
    cases = [
        (dict(policy="snapkvv", topk=8), "unknown policy='snapkvv'; use one of"),
        (dict(policy="knorm", topk=8, compression=0.9), "give topk= (long-range slots) or compression="),
        (dict(policy="kvpop", scorer=str(tmp_path / "wrong_shape")), "was made for num_kv_heads=1"),
        (dict(policy="kvpop"), "needs scorer=DIR"),
        (dict(policy="knorm"), "needs a budget: topk=K"),
        (dict(policy="knorm", compression=1.5), "must be a ratio in (0, 1)"),
        (dict(policy="dense", topk=8), "policy=dense keeps every token; drop topk"),
        (dict(policy="knorm", topk=8, scorer="x"), "takes no scorer checkpoint"),
        (dict(policy="knorm", topk="many"), "topk='many' is not an integer"),
        (dict(policy="knorm", topk=8, prefill_chunk=0), "prefill_chunk"),
        (dict(policy="knorm", topk=8, compile="sometimes"), "compile='sometimes' is not auto, True or False"),
        (dict(policy="knorm", topk=8, batching="dynamic"), "batching='dynamic' is not continuous or static"),
        (dict(policy="knorm", topk=8, max_rows=0), "max_rows must be an integer >= 1, got 0"),
        (dict(policy="knorm", topk=8, max_rows=4, batching="static"), "max_rows=4 sets the rows of batching=continuous"),
        (dict(policy="knorm", topk=-3.0), "topk must be a non-negative integer, got -3;"),  # lm-eval's CLI: -3.0
        (dict(policy="knorm", topk=8, windw=8), "unknown argument windw= (did you mean window=?). Valid: the kvpop"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match="kvpop model_args|was made for") as err:
            KVpopLM(pretrained=str(config_only), device="cpu", **args)
        assert msg in str(err.value), (args, str(err.value))
    with pytest.raises(OSError):  # good arguments get as far as the (missing) weights
        KVpopLM(pretrained=str(config_only), device="cpu", policy="knorm", topk=8)
    # from_pretrained options and config fields are model_args too
    with pytest.raises(OSError):
        KVpopLM(pretrained=str(config_only), device="cpu", policy="knorm", topk=8, low_cpu_mem_usage=True,
                max_window_layers=2)


@pytest.mark.tier("scripts")  # the command line
@pytest.mark.parametrize("args, msg", [(",windw=8", r"unknown argument windw= \(did you mean window=\?\)"),
                                       (",topk=-3", "topk must be a non-negative integer, got -3;")])
def test_cli_checks_model_args_before_lm_eval_starts(config_only, monkeypatch, args, msg):
    """A bad kvpop model_arg stops kvpop-lm-eval before lm-eval looks at its tasks (an unknown task would fail
    there) and before any weights load (the folder has none)."""
    from kvpop_hf.integrations.lm_eval import main

    monkeypatch.setattr(sys, "argv", ["kvpop-lm-eval"])
    with pytest.raises(ValueError, match=msg):
        main(["run", "--model", "kvpop", "--model_args", f"pretrained={config_only},policy=knorm,window=8{args}",
              "--tasks", "no_such_task", "--device", "cpu"])


# -- the exporter -----------------------------------------------------------------------------------
def test_exported_problems_are_kvpop_evals_and_fit_the_length(tasks_dir, tiny_dir):
    from transformers import AutoTokenizer

    from kvpop_lab.testbed import make_problem

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [json.loads(x) for x in (tasks_dir / "kvpop_vt_160.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [2 ** 48 + i for i in range(3)]
    for r in rows:
        p = make_problem("vt", length=160, seed=r["seed"])  # the testbed tokenizer: kvpop-eval's problem as is
        assert (r["prompt"], r["answer"]) == (p.prompt, p.answer)
        assert 150 <= r["n_tokens"] <= 160
        assert len(tok(r["prompt"] + " " + r["answer"]).input_ids) + 1 == r["n_tokens"]
    single = [json.loads(x) for x in (tasks_dir / "kvpop_niah_single_160.jsonl").read_text().splitlines()]
    assert all(r["prompt"].count("one of the special magic numbers for") == 1 for r in single)  # one needle


def test_exporter_fits_another_tokenizer(tmp_path):
    """A tokenizer that splits words into characters: the generator's length is rescaled to fit."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvpop_lab.testbed.lm_eval_tasks import export_tasks

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 .:=;+-?\n_"))
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>", *chars])}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    export_tasks(tmp_path, tok, ["vt"], [600], n=2)
    for r in map(json.loads, (tmp_path / "kvpop_vt_600.jsonl").read_text().splitlines()):
        assert 560 <= r["n_tokens"] <= 600


def test_exporter_rejects_bad_arguments(tmp_path, tiny_dir):
    from kvpop_lab.testbed.lm_eval_tasks import export_tasks

    with pytest.raises(ValueError, match="unknown or no families"):
        export_tasks(tmp_path, str(tiny_dir), ["ruler_qa"], [256], n=1)
    with pytest.raises(ValueError, match="--temperature > 0"):
        export_tasks(tmp_path, str(tiny_dir), ["vt"], [256], n=1, repeats=4)


def test_over_rollouts_gives_pass_at_1_over_n_for_a_one_sample_task(tiny_dir, tasks_dir):
    """A task whose process_results scores one generation, run with repeats: 3 and take_first_k through
    over_rollouts: exact_match is the mean over the rollouts, pass_at_k whether any is right."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvpop_hf.integrations.lm_eval  # noqa: F401
    from kvpop_hf.integrations.lm_eval_rollouts import over_rollouts
    from kvpop_lab.testbed.tokenizer import extract_answer, normalize

    def one(doc, results):
        assert isinstance(results[0], str)
        return {"exact_match": float(extract_answer(results[0]) == normalize(doc["answer"]))}

    assert over_rollouts(one)({"answer": "7"}, [["answer : 7", "8", "answer : 7 ."]]) == {
        "exact_match": pytest.approx(1 / 3), "pass_at_k": 1.0}
    (tasks_dir / "rollouts.py").write_text(
        "from kvpop_hf.integrations.lm_eval_rollouts import over_rollouts\n"
        "from kvpop_lab.testbed.tokenizer import extract_answer, normalize\n\n\n"
        "def one(doc, results):\n"
        "    return {'exact_match': float(extract_answer(results[0]) == normalize(doc['answer']))}\n\n\n"
        "process_results = over_rollouts(one)\n")
    (tasks_dir / "vt_n3.yaml").write_text(
        "include: kvpop_vt_160.yaml\ntask: vt_n3\nrepeats: 3\n"
        "generation_kwargs: {until: [], do_sample: true, temperature: 1.0, max_gen_toks: 6}\n"
        "filter_list: [{name: rollouts, filter: [{function: take_first_k, k: 3}]}]\n"
        "process_results: !function rollouts.process_results\n")
    res = lm_eval.simple_evaluate(model="kvpop", model_args=f"pretrained={tiny_dir},dtype=float32,policy=knorm,"
                                  f"sinks=2,window=8,topk={TOPK}", tasks=["vt_n3"], device="cpu", batch_size=3,
                                  task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True)
    samples = res["samples"]["vt_n3"]
    assert len(samples) == 3 and all(len(s["filtered_resps"][0]) == 3 for s in samples)
    want = [one(s["doc"], [r])["exact_match"] for s in samples for r in s["filtered_resps"][0]]
    assert res["results"]["vt_n3"]["exact_match,rollouts"] == pytest.approx(sum(want) / 9)


def test_compression_budget_follows_each_context(tiny_dir, caplog):
    from transformers import AutoConfig

    from kvpop_hf.integrations.policy_args import parse_policy_args

    cfg = AutoConfig.from_pretrained(tiny_dir)
    kv = parse_policy_args(cfg, str(tiny_dir), "knorm", sinks=2, window=8, compression=0.5)
    assert kv.budget(100) == (2, 8, 40) and kv.budget(101) == (2, 8, 40) and kv.budget(1000) == (2, 8, 490)
    assert kv.make_cache(100).budget == 50 and kv.short_requests == 0
    assert kv.budget(10) == (2, 8, 0) and kv.short_requests == 1  # B = 5 < sinks + window: sinks + window kept
    from kvpop_hf.integrations.policy_args import PolicyArgs

    # window-only policies (StreamingLLM+) spend the whole budget beyond the sinks on the window
    assert PolicyArgs("streaming_plus", cfg, sinks=2, window=8, topk=10).budget(100) == (2, 18, 0)
    assert PolicyArgs("streaming_plus", cfg, sinks=2, window=8, compression=0.5).budget(100) == (2, 48, 0)
    lm = _lm(tiny_dir, policy="knorm", sinks=2, window=64, compression=0.9)
    with caplog.at_level("WARNING"):
        lm.generate_until(_gen_requests(PROMPTS[:1], max_gen_toks=2))
    assert "kept sinks + window" in caplog.text


@pytest.mark.parametrize("args, compiles", [
    (dict(topk=TOPK), True),                        # auto, fixed budget: generate may compile
    (dict(compression=0.5), False),                 # auto, a budget per prompt length: eager
    (dict(compression=0.5, compile=True), True),
    (dict(topk=TOPK, compile="False"), False),      # as lm-eval's command line hands it over
])
def test_compile_choice_reaches_generate(tiny_dir, args, compiles, monkeypatch):
    """Static batches: ``generate(disable_compile=...)``; continuous: ``generate_batch(compile=...)`` (None: on
    CUDA, as generate decides; False: eager)."""
    import kvpop_hf.batch

    static = _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, batching="static", **args)
    seen = []
    generate = static.model.generate
    monkeypatch.setattr(static.model, "generate", lambda *a, **kw: seen.append(kw.get("disable_compile")) or generate(*a, **kw))
    static.generate_until(_gen_requests(PROMPTS[:2], max_gen_toks=2))
    assert seen and all(d is (None if compiles else True) for d in seen), seen
    seen.clear()
    batch = kvpop_hf.batch.generate_batch
    monkeypatch.setattr(kvpop_hf.batch, "generate_batch", lambda *a, **kw: seen.append(kw["compile"]) or batch(*a, **kw))
    lm = _lm(tiny_dir, policy="knorm", sinks=SINKS, window=WINDOW, **args)
    lm.generate_until(_gen_requests(PROMPTS[:2], max_gen_toks=2))
    assert seen and all(c is (None if compiles else False) for c in seen), seen
    seen.clear()  # a request's own disable_compile (a generate option) keeps it on generate_batch, eager
    lm.generate_until(_gen_requests(PROMPTS[:2], max_gen_toks=2, disable_compile=True))
    assert seen and all(c is False for c in seen), seen


def test_ruler_style_generators():
    from kvpop_lab.testbed.ruler_tasks import niah_multiquery, niah_multivalue
    from kvpop_lab.testbed.tokenizer import count_tokens

    for fn, kw in ((niah_multivalue, {"num_values": 3}), (niah_multiquery, {"num_needles": 5, "num_queries": 3})):
        p = fn(7, length=300, **kw)
        assert p == fn(7, length=300, **kw) and p != fn(8, length=300, **kw)
        assert 296 <= p.meta["n_tokens"] == 1 + count_tokens(p.prompt) + count_tokens(p.target) + 1 <= 300
        values = p.answer.split(" , ")
        assert len(values) == 3 and p.prompt.endswith("mentioned in the text ?\nanswer :")
        where = [p.prompt.index(f"is : {v} .") for v in values]
        if fn is niah_multivalue:  # in order of appearance
            assert where == sorted(where) and p.prompt.count(p.meta["key"]) == 4
        else:  # in the question's order
            question = p.prompt.rsplit("\n", 2)[1]
            assert [question.index(k) for k in p.meta["query_keys"]] == sorted(question.index(k) for k in p.meta["query_keys"])
            assert all(p.meta["needles"][k] == v for k, v in zip(p.meta["query_keys"], values))
    with pytest.raises(ValueError, match="num_queries=6 must be <= num_needles=5"):
        niah_multiquery(0, length=300, num_needles=5, num_queries=6)
    with pytest.raises(ValueError, match="too small"):
        niah_multivalue(0, length=64, num_values=8)


def test_exporter_command_line(tmp_path, tiny_dir):
    from kvpop_lab.testbed.lm_eval_tasks import main

    assert main(["--out", str(tmp_path), "--tokenizer", str(tiny_dir), "--families", "niah_multivalue,niah_multiquery",
                 "--lengths", "256", "--n", "2", "--knob", "niah_multiquery.num_queries=3"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "kvpop_niah_multiquery_256.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["answer"].split(" , ")) == 3 for r in rows)
    assert "kvpop_niah_multivalue_256" in (tmp_path / "kvpop_testbed.yaml").read_text()
    with pytest.raises(SystemExit, match="FAMILY one of"):
        main(["--out", str(tmp_path), "--tokenizer", str(tiny_dir), "--knob", "lookup.n_facts=3"])
    with pytest.raises(ValueError, match="unknown knob"):
        main(["--out", str(tmp_path), "--tokenizer", str(tiny_dir), "--families", "niah_multivalue",
              "--lengths", "256", "--n", "1", "--knob", "niah_multivalue.num_needles=3"])


def test_table_reads_recorded_settings_and_string_model_args(tmp_path):
    """Runs recorded by the kvpop model (its resolved settings) and older ones with a string model_args."""
    from kvpop_hf.integrations.lm_eval_table import collect_rows, markdown_table

    def write(name, config, value):
        d = tmp_path / name / "model"
        d.mkdir(parents=True)
        (d / "results_2026.json").write_text(json.dumps({
            "config": config, "results": {"t1": {"exact_match,none": value}, "grp": {"exact_match,none": 0.0}},
            "group_subtasks": {"grp": ["t1"]}, "n-samples": {"t1": {"effective": 4}}}))
        return tmp_path / name

    runs = [write("hf", {"model": "hf", "model_args": "pretrained=x"}, 1.0),
            write("kv", {"model": "kvpop", "model_args": {"pretrained": "x", "policy": "kvpop", "scorer": "s"},
                         "kvpop": {"policy": "kvpop", "sinks": 4, "window": 64, "topk": 424, "compression": None}}, 0.75),
            write("sn", {"model": "kvpop", "model_args": "pretrained=x,policy=snapkv,compression=0.88"}, 0.5)]
    rows = collect_rows(runs, length=4096)
    assert [(r["policy"], r["budget"], r["task"], r["value"], r["n"]) for r in rows] == [
        ("dense", "full", "t1", 1.0, 4), ("kvpop", 492, "t1", 0.75, 4), ("snapkv", "cr88", "t1", 0.5, 4)]
    assert rows[1]["cr"] == pytest.approx(1 - 492 / 4096) and rows[2]["cr"] == 0.88
    md = markdown_table(rows)
    assert "| kvpop | 492 | 0.880 | 0.750 | 0.750 | 75.0% |" in md
    with pytest.raises(ValueError, match="no lm-eval results"):
        collect_rows([tmp_path / "missing"])



def _results(folder: Path, config: dict, values: dict) -> Path:
    """An lm-eval --output_path folder with one results file: ``values`` task -> exact_match."""
    d = folder / "model"
    d.mkdir(parents=True)
    (d / "results_2026.json").write_text(json.dumps({
        "config": config, "results": {t: {"exact_match,none": v} for t, v in values.items()},
        "n-samples": {t: {"effective": 4} for t in values}}))
    return folder


def test_table_compares_runs_with_dense_over_their_common_tasks(tmp_path, capsys):
    """A run without one of dense's tasks is compared with dense over the tasks both have (not its own mean over
    fewer tasks against dense's mean over more: 0.5 / 0.25 = 200%), and marked, with a note naming the task."""
    from kvpop_hf.integrations.lm_eval_table import main

    kv = {"model": "kvpop", "model_args": "pretrained=x,policy=knorm,sinks=2,window=8,topk=8"}
    runs = [_results(tmp_path / "dense", {"model": "hf", "model_args": "pretrained=x"}, {"easy": 0.5, "hard": 0.0}),
            _results(tmp_path / "knorm", kv, {"easy": 0.5}),
            _results(tmp_path / "sn", {"model": "kvpop", "model_args": "pretrained=x,policy=snapkv,compression=0.5"},
                     {"easy": 0.5, "hard": 0.0})]
    assert main([*map(str, runs), "--out", str(tmp_path / "table"), "--no-plot"]) == 0
    md = (tmp_path / "table" / "table.md").read_text()
    assert "| knorm | 18 | n/a | 0.500 | n/a | 0.500* | 100.0%* |" in md
    assert "| snapkv | cr50 | 0.500 | 0.500 | 0.000 | 0.250 | 100.0% |" in md  # same tasks: no mark
    assert "* knorm 18: no result for hard (avg over its 1 task(s)); vs dense over the 1 task(s) both have." in md
    assert "200.0%" not in md and "200.0%" not in capsys.readouterr().out


@pytest.mark.tier("scripts")  # the console command
def test_table_help_prints_whole(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpop_hf.integrations.lm_eval_table", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "the policy x compression table (markdown and CSV) and plot" in text
    assert "Columns are the tasks (groups left out)" in text and "runs whose task sets differ are marked" in text
    assert "--no-plot write table.md and table.csv only" in text


@pytest.mark.tier("quality")
def test_shipped_student_through_lm_eval_matches_kvpop_eval(tmp_path):
    """lm-eval's command line with --model kvpop and kvpop-eval on the same 4k problems, shipped student at 88%
    (B = 492, window 64): the exact matches agree within one problem (CPU, a few minutes)."""
    from kvpop_lab.bench import lm_eval_vs_kvpop_eval as bench

    root = Path(__file__).resolve().parents[1]
    student, teacher = root / "checkpoints/testbed-4k-kvpop-cr88", root / "checkpoints/testbed-4k-teacher"
    assert bench.main(["--student", str(student), "--teacher", str(teacher), "--n", "3", "--extra", "",
                       "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["n"] == 3 and abs(res["kvpop_eval_correct"] - res["lm_eval_correct"]) <= 1


def test_a_lora_adapter_folder_is_a_pretrained_student(tiny_dir, tmp_path):
    """``pretrained=`` a PEFT adapter folder (LoRA student + its scorer, as the trainer saves it): HFLM loads the
    base model named in ``adapter_config.json`` with ``peft=``, the folder is the checkpoint, and generation and
    log-likelihoods equal those of the same adapter merged into a plain model folder."""
    import shutil

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop_hf.integrations.lm_eval import KVpopLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    get_peft_model(base, lora).save_pretrained(adapter)
    KVpopCache(base.config, sinks=SINKS, window=WINDOW, topk=TOPK, scorer="mlstm").save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(adapter)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), adapter).merge_and_unload() \
        .save_pretrained(merged)
    for f in adapter.iterdir():
        if f.name.startswith(("kvpop_", "tokenizer")):
            shutil.copy(f, merged / f.name)
    reqs = _gen_requests(PROMPTS, max_gen_toks=8)
    a = KVpopLM(pretrained=str(adapter), policy="kvpop_distill", device="cpu", dtype="float32", batch_size=2)
    m = KVpopLM(pretrained=str(merged), policy="kvpop_distill", device="cpu", dtype="float32", batch_size=2)
    assert a.kv.scorer_path == str(adapter)
    assert a.generate_until(reqs) == m.generate_until(reqs)
    pairs = _ll_requests(LL_PAIRS)
    for (la, ga), (lm, gm) in zip(a.loglikelihood(pairs), m.loglikelihood(pairs)):
        assert abs(la - lm) < 1e-4 and ga == gm
    plain = KVpopLM(pretrained=str(tiny_dir), policy="knorm", sinks=SINKS, window=WINDOW, topk=TOPK, device="cpu",
                    dtype="float32", batch_size=2)
    assert plain.generate_until(reqs) != a.generate_until(reqs)  # the adapter is applied
