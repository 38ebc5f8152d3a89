"""The peers GPU call (benchmarks/gpu/peers.sh) on CPU: its speed runners on a tiny random model, the device lock
around a measurement, the quality runners' --device / --shard, and the script's argument checks. The kvpress side
runs in kvpress's own environment, as a subprocess of ``$KVPRESS_PYTHON`` (default
/work/peers/kvpress-venv/bin/python, docs/peers.md); without it those tests are skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpop_lab.peers.speed_rows import read_rows

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
KVPRESS_PYTHON = os.environ.get("KVPRESS_PYTHON", "/work/peers/kvpress-venv/bin/python")
needs_kvpress = pytest.mark.skipif(
    not Path(KVPRESS_PYTHON).is_file(),
    reason=f"no kvpress environment at {KVPRESS_PYTHON} (set KVPRESS_PYTHON; docs/peers.md shows how to build it)")
TINY = ["--shape", "tiny", "--new-tokens", "7", "--warmup", "2"]


def run_kvpress_side(*args, timeout=600):
    """A module of the kvpress side in kvpress's environment, kvpop_hf off the path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([KVPRESS_PYTHON, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_speed_ours_rows(tmp_path):
    from kvpop_lab.peers import speed_ours

    out = tmp_path / "kvpop.jsonl"
    assert speed_ours.main(["--system", "kvpop", *TINY, "--rows", "600x1", "600x2", "--prefill-chunk", "256",
                            "--synthetic-from", "2", "--device-lock", str(tmp_path / "lock"), "--out", str(out)]) == 0
    rows = read_rows(out)
    assert [(r["context"], r["batch"], r["filled"]) for r in rows] == [(600, 1, "prefill"), (600, 2, "in place")]
    assert all(r["system"] == "kvpop" and r["B"] == 72 and r["loop"] == "run_ahead" and r["projections"] == "fused"
               for r in rows)  # B = round(0.12 * 600)
    assert rows[0]["prefill_s"] > 0 and rows[1]["prefill_s"] is None and all(r["decode_ms"] > 0 for r in rows)
    static = tmp_path / "static.jsonl"
    assert speed_ours.main(["--system", "static", *TINY, "--rows", "600x1", "--out", str(static)]) == 0
    (row,) = read_rows(static)
    assert row["cache"] == "static" and row["B"] == 600 and row["loop"] == "stock" and row["prefill_s"] > 0


def test_speed_ours_refuses_a_budget_without_slots(tmp_path):
    from kvpop_lab.peers import speed_ours

    with pytest.raises(ValueError, match="B=60 <= sinks \\+ window"):
        speed_ours.main(["--system", "kvpop", *TINY, "--rows", "500x1", "--out", str(tmp_path / "x.jsonl")])
    with pytest.raises(ValueError, match="CONTEXTxBATCH"):
        speed_ours.main(["--system", "static", *TINY, "--rows", "32k", "--out", str(tmp_path / "x.jsonl")])


class _Turns:
    """A device lock that records its calls."""

    def __init__(self):
        self.calls = []

    def acquire(self):
        self.calls.append("acquire")

    def release(self):
        self.calls.append("release")


@pytest.mark.parametrize("whole", [False, True])
def test_measure_takes_the_device_for_what_it_times(whole):
    """Timed turns: the prefill up to the first token, then the decode steps after the first compiled one; whole:
    one turn."""
    import argparse

    from kvpop_lab.bench.generate_call_speed import measure
    from kvpop_lab.bench.shapes import build_model

    model = build_model("tiny", torch.device("cpu"), torch.float32, 512)
    args = argparse.Namespace(sinks=4, window=16, topk=44, prefill_chunk=64, new_tokens=7, warmup=2, synthetic_from=None,
                              compile_mode=None, no_retry=False, process="first")
    turns = _Turns()
    row = measure(model, "kvpop", "knorm", 200, 1, args, torch.device("cpu"), lock=turns, lock_whole=whole)
    assert turns.calls == (["acquire", "release"] if whole else ["acquire", "release", "acquire", "release"])
    assert row["decode_ms"] > 0 and row["prefill_s"] > 0 and row["decode_peak_gb"] == 0.0


@needs_kvpress
def test_speed_kvpress_rows(tmp_path):
    out = tmp_path / "kvpress.jsonl"
    res = run_kvpress_side("kvpop_lab.peers.speed_kvpress", *TINY, "--rows", "500x1", "500x2", "--device-lock",
                           str(tmp_path / "lock"), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_rows(out)
    assert [(r["context"], r["batch"], r["B"]) for r in rows] == [(500, 1, 60), (500, 2, 60)]
    assert all(r["entries_end"] == 60 for r in rows)  # the DecodingPress holds B after every step
    assert all(r["decode_ms"] > 0 and r["prefill_s"] > 0 and r["versions"]["kvpress"] == "0.5.5" for r in rows)
    assert rows[0]["versions"]["transformers"].startswith("5.2")
    grow = tmp_path / "prefill.jsonl"
    res = run_kvpress_side("kvpop_lab.peers.speed_kvpress", *TINY, "--rows", "500x1", "--mode", "prefill",
                           "--press", "streaming", "--out", str(grow))
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_rows(grow)[0]["entries_end"] == 60 + 7 - 1  # the prefill press alone: the cache grows by each step


@needs_kvpress
def test_run_kvpress_shard_on_a_device(tmp_path):
    """--shard runs its problems only, --device places the model, --device-lock wraps each generation: two short
    problems cut from the record's (the runner reads ids, budgets and lengths from the file)."""
    from transformers import AutoTokenizer

    from kvpop_lab.peers.problems import RECORD, problem_record, record_problems, write_jsonl

    tok = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "testbed-4k-teacher")
    rows = []
    for i, p in enumerate(record_problems(2)):
        row = problem_record(i, RECORD["seed_base"] + i, p, tok)
        rows.append(dict(row, prompt_ids=row["prompt_ids"][:400], max_new_tokens=5, budgets={"0.94": 100}))
    problems = tmp_path / "p.jsonl"
    write_jsonl(problems, rows)
    out = tmp_path / "s1"
    res = run_kvpress_side("kvpop_lab.peers.run_kvpress", "--problems", str(problems), "--out", str(out),
                           "--presses", "knorm", "--modes", "decoding", "--compressions", "0.94", "--device", "cpu",
                           "--shard", "1/2", "--device-lock", str(tmp_path / "lock"), "--threads", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "knorm_decoding_cr94.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == [1] and len(lines[0]["generated_ids"]) == 5 and lines[0]["entries_end"] == 100
    meta = json.loads((out / "meta.json").read_text())
    assert meta["shard"] == "1/2" and meta["device"] == "cpu" and meta["n"] == 2
    bad = run_kvpress_side("kvpop_lab.peers.run_kvpress", "--problems", str(problems), "--out", str(out),
                           "--shard", "2/2")
    assert bad.returncode == 2 and "I must be in [0, N)" in bad.stderr


def test_run_ours_shard_on_a_device(tmp_path):
    """--device places the model, --shard picks the problems, --device-lock wraps each generation: the dense
    teacher on problem 1 of two (right, as in the table of record)."""
    from kvpop_lab.peers import run_ours
    from transformers import AutoTokenizer

    from kvpop_lab.peers.problems import RECORD, problem_record, record_problems, write_jsonl

    tok = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "testbed-4k-teacher")
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [problem_record(i, RECORD["seed_base"] + i, p, tok) for i, p in enumerate(record_problems(2))])
    out = tmp_path / "s1"
    assert run_ours.main(["--problems", str(path), "--out", str(out), "--policies", "dense", "--device", "cpu",
                          "--shard", "1/2", "--device-lock", str(tmp_path / "lock")]) == 0
    lines = [json.loads(x) for x in (out / "dense.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == [1] and lines[0]["correct"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["shard"] == "1/2" and meta["device"] == "cpu" and meta["n"] == 2


def test_run_ours_refuses_a_bad_shard_or_device(tmp_path):
    from kvpop_lab.peers import run_ours

    from kvpop_lab.peers.problems import RECORD, write_jsonl

    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"index": i, "seed": RECORD["seed_base"] + i, "prompt_ids": [1]} for i in range(2)])
    with pytest.raises(SystemExit):
        run_ours.main(["--problems", str(path), "--out", str(tmp_path / "o"), "--shard", "1/3x"])
    with pytest.raises(SystemExit):
        run_ours.main(["--problems", str(path), "--out", str(tmp_path / "o"), "--n", "1", "--shard", "1/2"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            run_ours.main(["--problems", str(path), "--out", str(tmp_path / "o"), "--device", "cuda"])
    assert not (tmp_path / "o").exists()  # refused before any work


def _script(env: dict, cwd=ROOT):
    full = {k: v for k, v in os.environ.items() if k not in ("OUT", "DEVICE", "LIMIT", "KVPRESS_PYTHON")}
    full.update({"PEERS_CHECK_ONLY": "1", "KVPRESS_PYTHON": sys.executable}, **env)
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "peers.sh")], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("env, message", [
    ({}, "set OUT"),
    ({"OUT": "x", "DEVICE": "tpu"}, "DEVICE must be cuda or cpu"),
    ({"OUT": "x", "LIMIT": "0"}, "LIMIT must be a whole number >= 1"),
    ({"OUT": "x", "LIMIT": "81"}, "LIMIT must be <= 80"),
    ({"OUT": "x", "LIMIT": "4", "KVPRESS_PROCS": "5"}, "a shard needs a problem"),
    ({"OUT": "x", "DEADLINE": "60"}, "DEADLINE must be >= 120"),
    ({"OUT": "x", "SPEED_ROWS": "32k"}, "not CONTEXTxBATCH"),
    ({"OUT": "x", "PHASES": "train"}, "neither quality nor speed"),
    ({"OUT": "x", "SPEED_KVPOP_S": "-5"}, "SPEED_KVPOP_S must be a whole number"),
])
def test_script_refuses_bad_arguments(env, message):
    res = _script(env)
    assert res.returncode != 0 and message in res.stderr, res.stderr


def test_script_wants_the_wheels_without_a_kvpress_interpreter(tmp_path):
    (tmp_path / "benchmarks" / "gpu").mkdir(parents=True)
    (tmp_path / "benchmarks" / "gpu" / "lab_env.sh").write_text("")  # a checkout without .whl/kvpress
    res = _script({"OUT": "x", "KVPRESS_PYTHON": ""}, cwd=tmp_path)
    assert res.returncode == 2 and "no kvpress wheel in .whl/kvpress" in res.stderr, res.stderr


def test_script_accepts_its_defaults_and_wants_the_repository_root(tmp_path):
    res = _script({"OUT": str(tmp_path)})
    assert res.returncode == 0 and "arguments fine" in res.stdout, res.stderr
    res = _script({"OUT": str(tmp_path), "DEVICE": "cpu"})
    assert res.returncode == 0, res.stderr
    res = _script({"OUT": str(tmp_path)}, cwd=tmp_path)
    assert res.returncode == 2 and "repository root" in res.stderr


def test_too_few_new_tokens_for_the_warmup_is_refused_before_any_work():
    from kvpop_lab.peers.speed_rows import check_steps

    check_steps(5, 2)
    with pytest.raises(ValueError, match="--new-tokens 4 leaves no timed step after --warmup 2: use --new-tokens >= 5"):
        check_steps(4, 2)


def test_run_ours_skips_what_an_earlier_call_finished_and_the_merge_joins_both(tmp_path):
    """--done-in: the problems an earlier call's merged folder holds are skipped; merging that folder with the new
    run gives every problem once (how peers.sh RESUME_FROM finishes a quality table over two calls)."""
    from kvpop_lab.peers import run_ours
    from transformers import AutoTokenizer

    from kvpop_lab.peers.problems import RECORD, problem_record, record_problems, write_jsonl
    from kvpop_lab.peers.runfiles import merge_runs

    tok = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "testbed-4k-teacher")
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [problem_record(i, RECORD["seed_base"] + i, p, tok) for i, p in enumerate(record_problems(2))])
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_ours.main(["--problems", str(path), "--out", str(first), "--policies", "dense", "--n", "1"]) == 0
    with pytest.raises(SystemExit):  # not a run folder: refused before any work
        run_ours.main(["--problems", str(path), "--out", str(second), "--policies", "dense", "--done-in",
                       str(tmp_path)])
    assert not second.exists()
    assert run_ours.main(["--problems", str(path), "--out", str(second), "--policies", "dense", "--done-in",
                          str(first)]) == 0
    assert [json.loads(x)["index"] for x in (second / "dense.jsonl").read_text().splitlines()] == [1]
    assert merge_runs([first, second], tmp_path / "all") == {"dense": 2}
