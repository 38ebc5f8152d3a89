"""CPU smoke test of the leave-families-out pipeline (docs/retrofit_data.md) end to end at toy scale, through its two
GPU scripts: a tiny many-family teacher (two resumed training rounds of a few seconds at 512 tokens, then its per-
family dense table), and the leave-families-out driver (baselines, KVpop and DMS retrofitted on one family for two
steps, evaluation on the two held-out families with two problems each, the table builder). It checks that every
stage runs and hands over to the next and that the tables have the right rows; the numbers of so small a run mean
nothing."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("scripts")


ROOT = Path(__file__).resolve().parents[1]
FAMILIES = "reasoning,niah_multiquery,cwe"
LAYOUT = "niah_multiquery.restate_key=True"  # DATA_KNOBS: a family knob given to the teacher and to every evaluation


def _run(script, env, timeout=900):
    full = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                KVPOP_GIT_COMMIT="test", **env)
    r = subprocess.run(["bash", f"benchmarks/gpu/{script}"], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _rows(path):
    return list(csv.DictReader(open(path)))


def test_many_family_teacher_then_leave_families_out(tmp_path):
    work_t, out = tmp_path / "teacher_work", tmp_path / "out"
    teacher_env = dict(OUT=str(out / "t"), WORK=str(work_t), DEVICE="cpu", INIT="scratch", HIDDEN="64", LAYERS="1",
                       HEADS="4", KV_HEADS="2", HEAD_DIM="16", INTERMEDIATE="128", LENS="512:512", LEN="512", TB="2",
                       QUICK_N="1", EVAL_N="2", WORKERS="0", WINDOW="16", FAMILIES=FAMILIES, DEADLINE="900",
                       DATA_KNOBS=LAYOUT)
    for r in (1, 2):  # the second call resumes from the first one's teacher
        rc, log = _run("many_family_teacher.sh", teacher_env)
        assert rc == 0, log[-4000:]
        assert f"round {r} from " + ("scratch" if r == 1 else f"{work_t}/round1/teacher") in log, log[-3000:]
        assert (work_t / f"round{r}" / "teacher" / "config.json").is_file()
        assert (out / "t" / f"teacher_r{r}.tar").is_file() and (out / "t" / f"logs_r{r}.tar").is_file()
    man = json.loads((work_t / "round2" / "teacher" / "manifest.json").read_text())
    assert set(man["data"]["families"]) == set(FAMILIES.split(",")) | {"lookup"}
    assert man["args"]["init_from"] == f"{work_t}/round1/teacher"

    rc, log = _run("many_family_teacher.sh", {**teacher_env, "STAGE": "eval"})
    assert rc == 0, log[-4000:]
    table = _rows(work_t / "teacher_dense_em.csv")
    assert [r["family"] for r in table] == FAMILIES.split(",") and all(r["n"] == "2" for r in table)
    teacher = (work_t / "final_teacher.txt").read_text().strip()
    assert teacher == f"{work_t}/round2/teacher" and (out / "t" / "teacher_dense_em.md").is_file()

    work = tmp_path / "lfo_work"
    env = dict(OUT=str(out / "l"), WORK=str(work), TEACHER=teacher, DEVICE="cpu", LEN="512", WINDOW="16", STEPS="2",
               BS="1", EVAL_N="2", EBS="2", DEBS="2", SEEDS="0", COMPRESSIONS="88", FAMILIES=FAMILIES,
               ORDER="reasoning", KS="1", DEADLINE="900", DATA_KNOBS=LAYOUT)
    for stage in ("baselines", "train", "evaluate", "table"):
        rc, log = _run("leave_families_out.sh", {**env, "STAGE": stage, "K": "1", "HELDOUT_ONLY": "1"})
        assert rc == 0, (stage, log[-4000:])
    for pol in ("kvpop_distill", "dms"):
        ck = work / "k1" / "ckpt_s0" / f"{pol}_cr88"
        assert json.loads((ck / "lfo_training.json").read_text())["steps"] == 2
        assert (ck / "model_delta.json").is_file() and not (ck / "model.safetensors").exists()
    for name in ("baselines.tar", "ckpt_k1.tar", "train_logs_k1.tar", "eval_k1.tar", "table.md", "curve.png"):
        assert (out / "l" / name).is_file(), name

    rows = _rows(work / "tables" / "held_out.csv")
    learned = {(r["policy"], r["family"]) for r in rows if r["k"] == "1"}
    assert learned == {(p, f) for p in ("kvpop_distill", "dms") for f in ("niah_multiquery", "cwe")}
    assert all(r["heldout"] == "True" and r["n"] == "2" and r["compression"] == "0.8800" for r in rows if r["k"])
    base = {(r["policy"], r["family"]) for r in rows if not r["k"]}
    assert base == {(p, f) for p in ("dense", "snapkv", "streaming") for f in FAMILIES.split(",")}
    points = {(p["policy"], p["k"]) for p in _rows(work / "tables" / "curve.csv")}
    assert points == {("kvpop_distill", "1"), ("dms", "1"), ("dense", ""), ("snapkv", ""), ("streaming", "")}
    verdict = json.loads((work / "tables" / "verdict.json").read_text())
    assert [(v["policy"], v["compression"]) for v in verdict] == [("kvpop_distill", 0.88)]

    # DATA_KNOBS reach every evaluation and are part of the plan
    meta = json.loads((work / "baselines" / "eval_niah_multiquery" / "meta.json").read_text())
    assert meta["knobs"]["niah_multiquery"] == {"restate_key": True}
    assert json.loads((work / "plan.json").read_text())["data_knobs"] == LAYOUT

    # the plan of WORK is fixed: another retrofit order or other data knobs are refused before any work
    rc, log = _run("leave_families_out.sh", {**env, "STAGE": "baselines", "ORDER": "cwe"})
    assert rc == 2 and "holds another plan" in log
    rc, log = _run("leave_families_out.sh", {**env, "STAGE": "baselines", "DATA_KNOBS": ""})
    assert rc == 2 and "holds another plan" in log and "data_knobs" in log
    rc, log = _run("leave_families_out.sh", {**env, "STAGE": "baselines", "DATA_KNOBS": "niah_multiquery.restate=1"})
    assert rc == 2 and "DATA_KNOBS: niah_multiquery: unknown knob" in log


def test_retrofit_variety_runs_several_steps_a_call_until_done(tmp_path):
    """benchmarks/gpu/retrofit_variety.sh: each call runs steps while its time and the 8 returned files allow,
    the next call goes on from the folders, and the whole experiment ends in fewer calls than steps."""
    env = dict(MF_WORK=str(tmp_path / "mf"), LFO_WORK=str(tmp_path / "lw"), DEVICE="cpu", INIT="scratch",
               HIDDEN="64", LAYERS="1", HEADS="4", KV_HEADS="2", HEAD_DIM="16", INTERMEDIATE="128", LENS="512:512",
               LEN="512", TB="2", QUICK_N="1", EVAL_N="2", WORKERS="0", WINDOW="16", FAMILIES=FAMILIES,
               MAX_ROUNDS="1", STEPS="2", BS="1", EBS="2", DEBS="2", SEEDS="0", COMPRESSIONS="88", ORDER="reasoning",
               KS="1", CAP="120", HELDOUT_ONLY="1", DEADLINE="3000", MIN_STEP="10")
    logs = []
    for call in range(1, 6):
        out = tmp_path / f"out{call}"  # every device call starts with an empty OUT
        rc, log = _run("retrofit_variety.sh", {**env, "OUT": str(out)}, timeout=1200)
        assert rc == 0, log[-4000:]
        assert len([p for p in out.iterdir() if p.is_file()]) <= 8, sorted(p.name for p in out.iterdir())
        logs.append(log)
        if "every step has run" in log:
            break
    steps = [line for log in logs for line in log.splitlines() if line.startswith("next step: ") and
             "the next call runs it" not in line]
    assert "every step has run" in logs[-1], "\n".join(logs)[-4000:]
    assert len(logs) == 3 and len(steps) == 6, steps  # 6 steps in 3 calls
    assert "could take OUT past 8 files" in logs[0]
    assert (tmp_path / "lw" / "tables" / "table.md").is_file()


def _knob(schedule, r, key):
    r = subprocess.run(["bash", "-c", 'source benchmarks/gpu/rounds.sh && schedule_knob "$@"', "_", str(schedule),
                        str(r), key], cwd=ROOT, capture_output=True, text=True)
    return r.returncode, r.stdout.strip(), r.stderr


@pytest.mark.parametrize("env, want", [
    ({}, "benchmarks/gpu/many_family_schedule.txt"),
    ({"GROW": "--layers 12"}, "benchmarks/gpu/many_family_grown_schedule.txt"),
    ({"INIT": "scratch"}, ""),
    ({"GROW": "--layers 12", "SCHEDULE": "x.txt"}, "x.txt"),
    ({"SCHEDULE": ""}, ""),
])
def test_teacher_schedule_defaults(env, want):
    """The schedule a teacher round reads: SCHEDULE when set (even empty), else none from scratch, the grown
    teacher's with GROW, the many-family one otherwise."""
    base = {k: v for k, v in os.environ.items() if k not in ("GROW", "INIT", "SCHEDULE")}
    r = subprocess.run(["bash", "-c", "source benchmarks/gpu/rounds.sh && teacher_schedule"], cwd=ROOT,
                       capture_output=True, text=True, env={**base, **env})
    assert r.returncode == 0 and r.stdout.strip() == want, (env, r.stdout, r.stderr)


def test_schedule_knob_reads_round_lines(tmp_path):
    s = tmp_path / "s.txt"
    s.write_text("# a comment\n1: TB=5 LENS=512:512 LR=1e-3   # trailing comment\n\n"
                 "2: TB=7 FAMILY_WEIGHTS=vt=0.1,cwe=0.2\n")
    assert _knob(s, 1, "TB")[:2] == (0, "5") and _knob(s, 1, "LR")[:2] == (0, "1e-3")
    assert _knob(s, 2, "TB")[:2] == (0, "7") and _knob(s, 2, "LR")[:2] == (0, "")  # a line sets only what it names
    assert _knob(s, 2, "FAMILY_WEIGHTS")[:2] == (0, "vt=0.1,cwe=0.2")
    assert _knob(s, 5, "TB")[:2] == (0, "7")  # past the last line: the last line
    assert _knob("", 1, "TB")[:2] == (0, "")  # no schedule
    for text, needle in (("1: TB=5 LRR=1\n", "LRR=1 is not KEY=VALUE"), ("1: TB=5\n3: TB=6\n", "round 3 where round 2"),
                         ("TB=5\n", 'starts with "<round>:"')):
        s.write_text(text)
        rc, _, err = _knob(s, 1, "TB")
        assert rc == 2 and needle in err, (text, err)
    assert _knob(tmp_path / "missing.txt", 1, "TB")[0] == 2


def test_teacher_round_follows_the_schedule_and_the_environment_wins(tmp_path):
    sched = tmp_path / "schedule.txt"
    sched.write_text("1: TB=2 LENS=512:512 LR=3e-3 REASONING_WEIGHT=0.2 LOOKUP_WEIGHT=0.05 "
                     "FAMILY_WEIGHTS=niah_multiquery=0.5\n2: TB=1 LR=2e-3\n")
    env = dict(OUT=str(tmp_path / "out"), WORK=str(tmp_path / "w"), DEVICE="cpu", INIT="scratch", HIDDEN="32",
               LAYERS="1", HEADS="2", KV_HEADS="1", HEAD_DIM="16", INTERMEDIATE="64", LEN="512", QUICK_N="1",
               WORKERS="0", WINDOW="16", FAMILIES=FAMILIES, DEADLINE="600", SCHEDULE=str(sched), LENS="512:512")
    layout = "niah_multiquery.adjacent_key=True niah_multiquery.restate_key=True"
    rc, log = _run("many_family_teacher.sh", {**env, "LOOKUP_WEIGHT": "0.15", "DATA_KNOBS": layout})
    assert rc == 0, log[-4000:]
    manifest = json.loads((tmp_path / "w" / "round1" / "teacher" / "manifest.json").read_text())
    want = {"adjacent_key": True, "restate_key": True}  # DATA_KNOBS reach the training and the quick evaluation
    assert manifest["data"]["knobs"]["niah_multiquery"] == want
    assert json.loads((tmp_path / "w" / "round1" / "quick" / "meta.json").read_text())["knobs"]["niah_multiquery"] == want
    args = manifest["args"]
    assert (args["time_budget"], args["lr"], args["reasoning_weight"]) == (2.0, 3e-3, 0.2)
    assert args["family_weight"] == [["niah_multiquery", 0.5]]
    assert args["lookup_weight"] == 0.15  # given in the environment: wins over the schedule's 0.05

    # FROM=2:FOLDER: round 2 continues FOLDER instead of round 1's teacher; a bad FROM is refused before any work
    other = tmp_path / "w" / "round1" / "teacher"
    rc, log = _run("many_family_teacher.sh", {**env, "WORK": str(tmp_path / "wf"), "FROM": f"2:{other}"})
    assert rc == 0 and "round 1 from scratch" in log, log[-3000:]
    rc, log = _run("many_family_teacher.sh", {**env, "WORK": str(tmp_path / "wf"), "FROM": f"2:{other}", "TB": "1"})
    assert rc == 0 and f"round 2 from {other}" in log, log[-3000:]
    for bad in (f"{other}", f"x:{other}", f"2:{tmp_path}"):
        rc, log = _run("many_family_teacher.sh", {**env, "WORK": str(tmp_path / "w3"), "FROM": bad})
        assert rc == 2 and "give ROUND:FOLDER" in log and not (tmp_path / "w3").exists(), (bad, log[-2000:])

    # GROW: round 1 continues INIT grown by kvpop_lab.grow_teacher; a GROW without a teacher to grow is refused
    grown = {**env, "WORK": str(tmp_path / "wg"), "INIT": str(other), "GROW": "--layers 2 --heads 4 --kv-heads 2"}
    rc, log = _run("many_family_teacher.sh", grown)
    assert rc == 0 and f"round 1 from {tmp_path / 'wg' / 'grown'}" in log, log[-3000:]
    cfg = json.loads((tmp_path / "wg" / "round1" / "teacher" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (2, 4, 2)
    rc, log = _run("many_family_teacher.sh", {**grown, "WORK": str(tmp_path / "wg2"), "INIT": "scratch"})
    assert rc == 2 and "nothing to grow" in log and not (tmp_path / "wg2").exists(), log[-2000:]
    # INIT is read by round 1 only: a later round runs without it, a first round is refused before any work
    gone = str(tmp_path / "gone")
    rc, log = _run("many_family_teacher.sh", {**grown, "INIT": gone, "TB": "1"})
    assert rc == 0 and f"round 2 from {tmp_path / 'wg' / 'round1' / 'teacher'}" in log, log[-3000:]
    rc, log = _run("many_family_teacher.sh", {**grown, "WORK": str(tmp_path / "wg3"), "INIT": gone})
    assert rc == 2 and "holds no model" in log and not (tmp_path / "wg3").exists(), log[-2000:]

    for bad, why in (("niah_multiquery.adjacent_key=yes", "adjacent_key must be True or False"),
                     ("niah_multiquery.layout=1", "unknown knob"), ("adjacent_key=True", "FAMILY.KEY=VALUE")):
        rc, log = _run("many_family_teacher.sh", {**env, "WORK": str(tmp_path / "wk"), "DATA_KNOBS": bad})
        assert rc == 2 and "DATA_KNOBS: " in log and why in log and not (tmp_path / "wk").exists(), (bad, log[-2000:])

    sched.write_text("1: TB=2 LR=oops=1 SEQ=3\n")  # a bad schedule is refused before any work
    rc, log = _run("many_family_teacher.sh", {**env, "WORK": str(tmp_path / "w2")})
    assert rc == 2 and "SEQ=3 is not KEY=VALUE" in log and not (tmp_path / "w2").exists()


@pytest.mark.parametrize("name", ["many_family_schedule.txt", "many_family_grown_schedule.txt",
                                  "many_family_drill_schedule.txt"])
def test_shipped_schedule_is_valid(name):
    """Every round of a shipped teacher schedule (benchmarks/gpu/) parses and gives a valid mixture that holds the six
    families of the experiment."""
    from kvpop_lab.pretrain_teacher import mixture_weights

    sched = ROOT / "benchmarks" / "gpu" / name
    rounds = [l.split(":")[0] for l in sched.read_text().splitlines() if l.split("#")[0].strip()]
    assert rounds == [str(r) for r in range(1, len(rounds) + 1)] and len(rounds) >= 4
    from kvpop_lab.bench.leave_families_out import FAMILIES as six

    for r in range(1, len(rounds) + 1):
        got = {k: _knob(sched, r, k) for k in ("TB", "LENS", "LR", "REASONING_WEIGHT", "LOOKUP_WEIGHT", "FAMILY_WEIGHTS",
                                                "TRAIN_FAMILIES")}
        assert all(rc == 0 for rc, _, _ in got.values()), got
        v = {k: out for k, (_, out, _) in got.items()}
        assert float(v["TB"]) > 0 and float(v["LR"]) > 0
        lo, hi = map(int, v["LENS"].split(":"))
        assert 256 <= lo <= hi <= 4096
        named = [(f, float(w)) for f, w in (p.split("=") for p in v["FAMILY_WEIGHTS"].split(",") if p)]
        fams = v["TRAIN_FAMILIES"].split(",") if v["TRAIN_FAMILIES"] else list(six)  # the script's FAMILIES
        assert set(six) <= set(fams)
        w = mixture_weights(float(v["REASONING_WEIGHT"]), float(v["LOOKUP_WEIGHT"]), named, fams)
        assert abs(sum(w.values()) - 1) < 1e-6 and min(w.values()) > 0, (r, w)
