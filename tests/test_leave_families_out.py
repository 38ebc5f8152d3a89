"""The leave-families-out bookkeeping (kvpop_lab.bench.leave_families_out): the plan's checks and the table builder's
statistics on evaluation folders generated here in kvpop-eval's formats (results.csv through the testbed's own
writer; outputs.jsonl for a run cut short), checked against the same numbers computed directly from the draws."""

from __future__ import annotations

import csv
import json
import math
import random
import statistics

import pytest

from kvpop_hf.policies import parse_budgets
from kvpop_lab.bench import leave_families_out as lfo
from kvpop_lab.testbed.report import write_results_csv

pytestmark = pytest.mark.tier("scripts")

LENGTH, N = 1024, 20
FAMS = ("reasoning", "vt", "niah_multivalue", "cwe")


def _write_eval(folder, runs, outputs_only=False):
    """``runs``: {(policy, compression or None): {family: [0/1 per problem]}} -> a kvpop-eval folder."""
    folder.mkdir(parents=True)
    rows, outs = [], []
    for (policy, comp), by_family in runs.items():
        b = None if comp is None else parse_budgets(compression=str(comp), length=LENGTH, sinks=4, window=32)[0]
        for fam, hits in by_family.items():
            rows.append({"policy": policy, "budget": "full" if b is None else b.B, "cr": 0.0 if b is None else b.cr,
                         "sinks": "", "window": "", "topk": "", "family": fam, "em": sum(hits) / len(hits),
                         "token_acc": 0.5, "lookup_acc": float("nan"), "n": len(hits), "n_target_tokens": 10})
            outs += [{"policy": policy, "budget": "full" if b is None else b.B, "family": fam, "seed": i,
                      "token_acc": 0.5, "correct": bool(h)} for i, h in enumerate(hits)]
    if outputs_only:
        (folder / "outputs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outs))
    else:
        write_results_csv(rows, folder / "results.csv")


def _draw(rng, p):
    return [int(rng.random() < p) for _ in range(N)]


@pytest.fixture()
def work(tmp_path):
    """A plan over four families (retrofit order reasoning, vt; k = 1, 2) and generated evaluations: the baselines
    on every family, KVpop and DMS at 88% and 94% with two seeds on every family. KVpop at k = 2 answers every cwe
    problem (as dense does): a held-out family at >= 0.9 of dense; everything else is drawn at random."""
    plan = lfo.make_plan(FAMS, ("reasoning", "vt"), (1, 2), length=LENGTH)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rng = random.Random(7)
    draws = {}
    base = {("dense", None): {f: [1] * N if f == "cwe" else _draw(rng, 0.8) for f in FAMS}}
    for pol in ("snapkv", "streaming"):
        for c in (0.88, 0.94):
            base[(pol, c)] = {f: _draw(rng, 0.5) for f in FAMS}
    _write_eval(tmp_path / "baselines" / "eval_all", base)
    draws["base"] = base
    for k in (1, 2):
        for seed in (0, 1):
            runs = {}
            for pol in ("kvpop_distill", "dms"):
                for c in (0.88, 0.94):
                    runs[(pol, c)] = {f: [1] * N if (pol, k, f) == ("kvpop_distill", 2, "cwe")
                                      else _draw(rng, rng.uniform(0.1, 0.7)) for f in FAMS}
                    ck = tmp_path / f"k{k}" / f"ckpt_s{seed}" / f"{pol}_cr{round(c * 100)}"
                    ck.mkdir(parents=True)
                    (ck / lfo.RECORD).write_text(json.dumps({"steps": 100 + k, "train_seconds": 9.5}))
            draws[(k, seed)] = runs
            # seed 1 of k = 2 was cut by its time limit: only outputs.jsonl
            for pol in ("kvpop_distill", "dms"):
                _write_eval(tmp_path / f"k{k}" / f"eval_{pol}_s{seed}",
                            {key: v for key, v in runs.items() if key[0] == pol}, outputs_only=(k, seed) == (2, 1))
    return tmp_path, plan, draws


def _read(path):
    return list(csv.DictReader(open(path)))


def test_held_out_table_matches_the_draws(work, tmp_path):
    root, plan, draws = work
    out = tmp_path / "tables"
    lfo.build_tables(root, out)
    rows = {(r["policy"], r["compression"], r["k"], r["family"]): r for r in _read(out / "held_out.csv")}
    dense = {f: sum(h) / N for f, h in draws["base"][("dense", None)].items()}
    for k in (1, 2):
        for pol in ("kvpop_distill", "dms"):
            for c in (0.88, 0.94):
                for fam in FAMS:
                    ems = [sum(draws[(k, s)][(pol, c)][fam]) / N for s in (0, 1)]
                    em = statistics.mean(ems)
                    se = math.sqrt(statistics.stdev(ems) ** 2 / 2 + em * (1 - em) / N)
                    r = rows[(pol, f"{c:.4f}", str(k), fam)]
                    assert float(r["em"]) == pytest.approx(em, abs=1e-4)
                    assert float(r["se"]) == pytest.approx(se, abs=1e-4)
                    assert float(r["ratio"]) == pytest.approx(em / dense[fam], abs=1e-4)
                    assert r["heldout"] == str(fam not in plan["splits"][str(k)]["retrofit"])
                    assert r["n_seeds"] == "2" and r["seeds"] == "0 1" and r["steps"] == f"{100 + k} {100 + k}"
    for c in (0.88, 0.94):  # a baseline: one run, binomial SE
        em = sum(draws["base"][("snapkv", c)]["vt"]) / N
        r = rows[("snapkv", f"{c:.4f}", "", "vt")]
        assert float(r["em"]) == pytest.approx(em, abs=1e-4)
        assert float(r["se"]) == pytest.approx(math.sqrt(em * (1 - em) / N), abs=1e-4)
    assert len(_read(out / "per_seed.csv")) == 2 * 2 * 2 * 2 * len(FAMS)  # k x seed x policy x compression x family


def test_curve_points_and_verdict(work, tmp_path):
    root, plan, draws = work
    res = lfo.build_tables(root, tmp_path / "t")
    common = plan["common_heldout"]
    assert common == ["niah_multivalue", "cwe"]
    dense = {f: sum(h) / N for f, h in draws["base"][("dense", None)].items()}
    points = {(p["policy"], p["compression"], p["k"]): p for p in res["curve"]}
    assert {(k) for (pol, c, k) in points if pol == "kvpop_distill" and c == 0.88} == {1, 2}
    for k in (1, 2):
        for c in (0.88, 0.94):
            per_fam = []
            for fam in common:
                ems = [sum(draws[(k, s)][("dms", c)][fam]) / N for s in (0, 1)]
                em = statistics.mean(ems)
                per_fam.append((em, statistics.stdev(ems) ** 2 / 2 + em * (1 - em) / N))
            p = points[("dms", c, k)]
            assert p["em"] == pytest.approx(statistics.mean(e for e, _ in per_fam), abs=1e-4)
            assert p["se"] == pytest.approx(math.sqrt(sum(v for _, v in per_fam)) / len(common), abs=1e-4)
            assert p["ratio"] == pytest.approx(p["em"] / statistics.mean(dense[f] for f in common), abs=1e-4)
    assert points[("dense", None, "")]["em"] == pytest.approx(statistics.mean(dense[f] for f in common))
    # the verdict, recomputed: the smallest k with a held-out family at >= 0.9 of dense, per compression
    for v in res["verdict"]:
        c = v["compression"]
        hits = sorted((k, fam) for k in (1, 2) for fam in plan["splits"][str(k)]["heldout"]
                      if dense[fam] and statistics.mean(sum(draws[(k, s)][("kvpop_distill", c)][fam]) / N
                                                        for s in (0, 1)) / dense[fam] >= 0.9)
        assert (2, "cwe") in hits  # the family KVpop answers in full at k = 2
        assert v["reached_at_k"] == hits[0][0]
        assert v["families_at_k"] == [f for k, f in hits if k == hits[0][0]]
    md = (tmp_path / "t" / "table.md").read_text()
    assert "KVpop >= 0.9 of dense on a held-out family at 88%: reached at k = " in md
    assert (tmp_path / "t" / "curve.png").stat().st_size > 0


def test_seeds_on_different_problems_are_refused(work, tmp_path):
    root, plan, draws = work
    runs = {("kvpop_distill", 0.88): {f: [1] * (N // 2) for f in FAMS}}
    _write_eval(root / "k1" / "eval_kvpop_distill_s7", runs)
    with pytest.raises(SystemExit, match="different numbers of problems"):
        lfo.build_tables(root, tmp_path / "t")


@pytest.mark.parametrize("args,msg", [
    ((FAMS, ("reasoning", "bogus"), (1,)), "unknown family bogus"),
    ((FAMS + ("needle_drill",), ("reasoning",), (1,)), "unknown family needle_drill.*drills train teachers only"),
    ((FAMS, ("lookup",), (1,)), "unknown family lookup"),
    ((FAMS, ("reasoning", "fwe"), (1, 2)), "fwe is not among --families"),
    ((FAMS, ("reasoning", "vt"), (2, 1)), "must increase"),
    ((FAMS, ("reasoning", "vt"), (1, 3)), "--order lists 2"),
    ((("reasoning", "vt"), ("reasoning", "vt"), (1, 2)), "no family is held out"),
    ((("vt", "vt", "cwe"), ("vt",), (1,)), "names a family twice"),
])
def test_plan_checks(args, msg):
    with pytest.raises(ValueError, match=msg):
        lfo.make_plan(*args, length=LENGTH)


def test_plan_and_split_commands(tmp_path, capsys):
    assert lfo.main(["plan", str(tmp_path), "--setting", "length=4096", "--setting", "window=64"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["length"] == 4096 and plan["window"] == 64 and plan["ks"] == [1, 2, 4]
    assert plan["common_heldout"] == ["niah_multivalue", "niah_multiquery"]
    capsys.readouterr()
    lfo.main(["split", str(tmp_path), "--k", "2", "--field", "retrofit"])
    assert capsys.readouterr().out.strip() == "reasoning,vt"
    lfo.main(["split", str(tmp_path), "--k", "2", "--field", "heldout"])
    assert capsys.readouterr().out.strip() == "niah_multikey,niah_multivalue,niah_multiquery,fwe"
    with pytest.raises(SystemExit, match="k=3 is not in the plan"):
        lfo.main(["split", str(tmp_path), "--k", "3"])
    with pytest.raises(SystemExit, match="length=<tokens per problem>"):
        lfo.main(["plan", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="KIND must be kvpop or dms"):
        lfo.main(["train", "snapkv", "--model", "x"])


def test_teacher_table(tmp_path):
    rng = random.Random(3)
    hits = {f: _draw(rng, 0.9) for f in FAMS}
    _write_eval(tmp_path / "eval", {("dense", None): {f: hits[f] for f in FAMS[:3]}})
    _write_eval(tmp_path / "eval_cwe", {("dense", None): {"cwe": hits["cwe"]}}, outputs_only=True)
    knobs = {FAMS[1]: {"restate_key": True, "adjacent_key": True}}  # kvpop-eval's meta.json: only the knobs given
    (tmp_path / "eval" / "meta.json").write_text(json.dumps({"knobs": knobs}))
    rows = lfo.teacher_table([tmp_path / "eval", tmp_path / "eval_cwe"], tmp_path / "out")
    assert [r["family"] for r in rows] == list(FAMS)
    for r in rows:
        em = sum(hits[r["family"]]) / N
        assert r["em"] == pytest.approx(em, abs=1e-5) and r["n"] == N and r["meets"] == (em >= 0.9)
        assert r["se"] == pytest.approx(math.sqrt(em * (1 - em) / N), abs=1e-5)
        assert r["knobs"] == ("restate_key=True adjacent_key=True" if r["family"] == FAMS[1] else "")
    md = (tmp_path / "out" / "teacher_dense_em.md").read_text()
    assert "every family >= 0.9" in md and f"| {FAMS[1]} |" in md and "| restate_key=True adjacent_key=True |" in md


def test_plan_of_a_work_folder_is_fixed(tmp_path):
    assert lfo.main(["plan", str(tmp_path), "--setting", "length=4096", "--setting", "steps=400"]) == 0
    assert lfo.main(["plan", str(tmp_path), "--setting", "length=4096", "--setting", "steps=400"]) == 0  # same: fine
    with pytest.raises(SystemExit, match="holds another plan.*steps: 400 -> 300"):
        lfo.main(["plan", str(tmp_path), "--setting", "length=4096", "--setting", "steps=300"])
    with pytest.raises(SystemExit, match="order"):
        lfo.main(["plan", str(tmp_path), "--order", "vt,reasoning", "--setting", "length=4096", "--setting", "steps=400"])


def test_retrofit_variety_picks_the_next_step(tmp_path):
    """benchmarks/gpu/retrofit_variety.sh (DRY=1): the step that the folders' contents call for."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    mf, lw = tmp_path / "mf", tmp_path / "lw"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], DRY="1",
               MF_WORK=str(mf), LFO_WORK=str(lw), FAMILIES="reasoning,cwe", KS="1,2", SEEDS="0", POLICIES="kvpop",
               COMPRESSIONS="88")

    def step(**extra):
        r = subprocess.run(["bash", "benchmarks/gpu/retrofit_variety.sh"], cwd=root, env={**env, **extra},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.split("next step: ")[1].splitlines()[0], r.stdout

    def touch(path, text=""):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    assert step()[0] == "teacher-train"
    touch(mf / "round1" / "teacher" / "config.json", "{}")
    quick = mf / "round1" / "quick"
    _write_eval(quick, {("dense", None): {"reasoning": [1] * N, "cwe": [1] * (N - 4) + [0] * 4}})  # cwe 0.8
    assert step()[0] == "teacher-train"
    assert step(QUICK_MIN="0.8")[0] == "teacher-eval"
    assert step(MAX_ROUNDS="1")[0] == "teacher-eval"
    touch(mf / "final_teacher.txt", str(mf / "round1" / "teacher"))
    lfo.teacher_table(quick, mf)
    name, out = step()
    assert name == "baselines" and "below 0.9 on cwe" in out
    for fam in ("reasoning", "cwe"):
        touch(lw / "baselines" / f"eval_{fam}" / "results.csv")
    assert step()[0] == "train 1"
    touch(lw / "k1" / "ckpt_s0" / "kvpop_distill_cr88" / lfo.RECORD)
    assert step()[0] == "evaluate 1"
    touch(lw / "k1" / "eval_kvpop_distill_s0" / "results.csv")
    assert step()[0] == "train 2"
    touch(lw / "k2" / "ckpt_s0" / "kvpop_distill_cr88" / lfo.RECORD)
    touch(lw / "k2" / "eval_kvpop_distill_s0" / "results.csv")
    assert step()[0] == "table"
    touch(lw / "tables" / "table.md")
    assert step()[0] == "done"
