"""The glue of the peers benchmark (benchmarks/kvpop_lab/peers): budgets, kvpress's ratio mapping, the problem file's round
trip, the exact-match rule on token ids, and the scorer's bookkeeping. No peer library is needed."""

import ast
import json
from pathlib import Path

import pytest
import torch

from kvpop_lab.peers import mapping, score
from kvpop_lab.peers.problems import (RECORD, budget, max_new_tokens, prefix_share, problem_record, read_jsonl, record_problems,
                            score_ids, write_jsonl)
from kvpop_lab.peers.run_ours import check_problems

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TEACHER)


@pytest.fixture(scope="module")
def problems():
    return record_problems(2)


def test_budgets_are_kvpop_evals():
    from kvpop_hf.policies import parse_budgets

    assert budget(0.88) == {"B": 492, "sinks": 4, "window": 64, "topk": 424}
    assert budget(0.94) == {"B": 246, "sinks": 4, "window": 64, "topk": 178}
    for c in (0.5, 0.75, 0.9):
        assert budget(c)["B"] == parse_budgets(compression=str(c), length=4096, sinks=4, window=64)[0].B == round((1 - c) * 4096)


@pytest.mark.parametrize("k_len", [492, 500, 3991, 3992, 4095, 8191])
@pytest.mark.parametrize("B", [1, 246, 292, 492])
def test_prefill_ratio_keeps_exactly_B(k_len, B):
    ratio = mapping.prefill_ratio(k_len, B)
    assert 0 <= ratio < 1
    assert mapping.n_kept(k_len, ratio) == B


def test_prefill_ratio_refuses_a_budget_beyond_the_prompt():
    with pytest.raises(ValueError, match="needs no compression"):
        mapping.prefill_ratio(200, 246)
    with pytest.raises(ValueError, match="budget must be"):
        mapping.prefill_ratio(200, 0)


def test_decoding_interval():
    assert mapping.decoding_interval("snapkv") == 65  # its score needs more buffered steps than its 64-query window
    assert {mapping.decoding_interval(p) for p in ("knorm", "streaming", "tova", "keydiff")} == {1}


def test_record_draw():
    assert RECORD["seed_base"] == 2 ** 48 + 5000 and RECORD["n"] == 80 and RECORD["length"] == 4096
    with pytest.raises(ValueError, match="n must be"):
        record_problems(0)


def test_problem_file_round_trip(tmp_path, tokenizer, problems):
    rows = [problem_record(i, RECORD["seed_base"] + i, p, tokenizer) for i, p in enumerate(problems)]
    path = tmp_path / "p.jsonl"
    assert write_jsonl(path, rows) == 2
    back = read_jsonl(path)
    assert back == json.loads(json.dumps(rows))
    for row, p in zip(back, problems):
        assert row["prompt_ids"][0] == tokenizer.bos_token_id
        assert row["prompt_ids"] == tokenizer(p.prompt)["input_ids"]
        assert row["max_new_tokens"] == max_new_tokens(p)
        assert row["budgets"] == {"0.88": 492, "0.94": 246}
    check_problems(problems, back, tokenizer)
    back[1]["prompt_ids"] = back[1]["prompt_ids"][:-1]
    with pytest.raises(ValueError, match="does not encode"):
        check_problems(problems, back, tokenizer)


def test_read_jsonl_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvpop_lab.peers.export"):
        read_jsonl(tmp_path / "none.jsonl")


class _Replay(torch.nn.Module):
    """A stand-in model whose generate appends fixed token ids: exact_match's verdict on known output."""

    def __init__(self, new_ids):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.new_ids = new_ids

    def generate(self, input_ids, **kw):
        return torch.cat([input_ids, torch.tensor([self.new_ids])], dim=1)


def _target_ids(tokenizer, problem, answer=None):
    text = problem.target if answer is None else problem.target.rsplit(" ", 1)[0] + f" {answer}"
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id, 7, 8]


def test_score_ids_agrees_with_kvpop_evals_exact_match(tokenizer, problems):
    from kvpop_lab.peers.problems import exact_match

    p = problems[0]
    wrong = str((int(p.answer) + 1) % 10)
    for ids, want in ((_target_ids(tokenizer, p), True), (_target_ids(tokenizer, p, wrong), False)):
        mine = score_ids(tokenizer, ids, p.answer)
        theirs = exact_match(_Replay(ids), tokenizer, [p], batch_size=1, progress=False)["outputs"][0]
        assert mine["correct"] is theirs["correct"] is want
        assert mine["prediction"] == theirs["prediction"] and mine["generated"] == theirs["generated"]


def test_prefix_share(problems):
    t = problems[0].target
    assert prefix_share(t, t) == 1.0
    words = t.split()
    assert prefix_share(" ".join(words[:3] + ["nope"] + words[4:]), t) == pytest.approx(3 / len(words))
    assert prefix_share("", t) == 0.0


def test_scorer_bookkeeping(tmp_path):
    assert score.em_se([True, False, True, True]) == (0.75, pytest.approx((0.75 * 0.25 / 4) ** 0.5))
    with pytest.raises(ValueError, match="no problems"):
        score.em_se([])
    assert score.common_prefix([{0: 1, 1: 1, 2: 1}, {0: 1, 1: 1}, {0: 1, 1: 1, 3: 1}]) == 2
    assert score.common_prefix([{1: 1}]) == 0
    assert score.mode_label("kvpress", "snapkv_decoding_cr88", {"mode": "decoding", "press": "snapkv"}) == \
        "prefill + decoding every 65"
    assert score.mode_label("kvpop", "tova_cr88", {}) == "fixed B"
    with pytest.raises(FileNotFoundError, match="no run files"):
        score.load_runs(tmp_path)


def _imports(path):
    tree = ast.parse(Path(path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


# the modules a kvpress process imports (its environment has no kvpop_hf)
PEER_SIDE = ["kvpop_lab.peers.run_kvpress", "kvpop_lab.peers.speed_kvpress", "kvpop_lab.peers.mapping",
             "kvpop_lab.peers.runfiles", "kvpop_lab.peers.device_lock", "kvpop_lab.peers.speed_rows",
             "kvpop_lab.peers.speed_table", "kvpop_lab.bench.shapes", "kvpop_lab.bench.step_times",
             "kvpop_lab.utils.provenance"]


def test_peer_runner_imports_nothing_of_kvpop_and_the_library_nothing_of_the_peers():
    for module in PEER_SIDE:
        path = ROOT / "benchmarks" / (module.replace(".", "/") + ".py")
        assert "kvpop_hf" not in _imports(path), path
    for f in (ROOT / "kvpop_hf").rglob("*.py"):
        assert not _imports(f) & {"kvpress", "trimkv"}, f


def test_peer_side_loads_no_kvpop_hf_module():
    """Imported (with their packages' __init__ and everything they import at module level), the kvpress side's
    modules leave no kvpop_hf module in sys.modules: they run where kvpop_hf is not installed."""
    import subprocess
    import sys

    code = ("import importlib, sys\n"
            f"for m in {PEER_SIDE!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'kvpop_hf' or m.startswith('kvpop_hf.'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**__import__("os").environ,
                         "PYTHONPATH": str(ROOT / "benchmarks")}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_run_files_resume(tmp_path):
    from kvpop_lab.peers.runfiles import open_run_file, write_meta

    path = tmp_path / "knorm_cr88.jsonl"
    path.write_text('{"index": 0}\n{"index": 1}\n{"index": 2, "gen')  # stopped mid-write
    fh, done = open_run_file(path, resume=True)
    fh.write('{"index": 2}\n')
    fh.close()
    assert done == {0, 1}
    assert [json.loads(x)["index"] for x in path.read_text().splitlines()] == [0, 1, 2]
    fh, done = open_run_file(path, resume=False)
    fh.close()
    assert done == set() and path.read_text() == ""
    write_meta(tmp_path, {"argv": ["a"], "commit": "c1", "date": "d1", "n": 3}, resume=False)
    write_meta(tmp_path, {"argv": ["b"], "commit": "c2", "date": "d2", "n": 3}, resume=True)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["commit"] == "c1" and meta["resumed"] == [{"argv": ["b"], "commit": "c2", "date": "d2"}]


def test_scorer_counts_variants_apart(tmp_path, tokenizer, problems):
    rows = [problem_record(i, RECORD["seed_base"] + i, p, tokenizer) for i, p in enumerate(problems)]
    kvpress, kvpop = tmp_path / "kvpress", tmp_path / "kvpop"
    for folder in (kvpress, kvpop):
        folder.mkdir()
        (folder / "meta.json").write_text('{"date": "2026-12-05"}')
    right = tokenizer(problems[0].target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    wrong = [tokenizer.eos_token_id]
    write_jsonl(kvpress / "knorm_prefill_cr88.jsonl", [
        {"index": i, "seed": r["seed"], "press": "knorm", "mode": "prefill", "compression": "0.88", "B": 492,
         "generated_ids": ids, "entries_end": 596} for i, (r, ids) in enumerate(zip(rows, (right, wrong)))])
    base = {"policy": "knorm", "compression": "0.88", "B": 492, "prediction": "", "answer": "", "generated": ""}
    write_jsonl(kvpop / "knorm_cr88.jsonl", [dict(base, index=i, seed=r["seed"], window=64, correct=False)
                                            for i, r in enumerate(rows)])
    write_jsonl(kvpop / "knorm_cr88_w168.jsonl", [dict(base, index=0, seed=rows[0]["seed"], window=168, correct=True)])
    out = score.table(rows, {"kvpress": kvpress, "kvpop": kvpop}, {"kvpress": "a", "kvpop": "b"},
                      {"kvpress": "c1", "kvpop": "c2"}, tokenizer)
    table, n, per_problem = out
    assert n == 2
    got = {(r["library"], r["mode"]): (r["n"], r["em"]) for r in table}
    assert got == {("kvpress 0.5.5", "prefill"): (2, "0.500"), ("kvpop-hf", "fixed B"): (2, "0.000"),
                   ("kvpop-hf", "fixed B, window 168"): (1, "1.000")}
    kp = next(r for r in table if r["library"] == "kvpress 0.5.5")
    assert kp["answered"] == "0.500" and float(kp["trace_prefix"]) == pytest.approx(0.5, abs=1e-3)
    cmp = {r["mode"]: r for r in score.compare(table, per_problem)}
    assert cmp["prefill"]["EM diff / SE"] == "+1.4" and cmp["fixed B, window 168"]["EM diff / SE"] == "inf"


def test_provenance_names_the_resumed_runs(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"commit": "aaaaaaa1", "date": "2026-12-05", "resumed": [
        {"commit": "bbbbbbb2"}, {"commit": "aaaaaaa1"}, {"commit": "bbbbbbb2"}, {"commit": "ccccccc3"}]}))
    assert score.provenance(tmp_path, None) == ("aaaaaaa (resumed at bbbbbbb, ccccccc)", "2026-12-05")
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match="names no commit"):
        score.provenance(tmp_path, None)
    assert score.provenance(tmp_path, "ddddddd4")[0] == "ddddddd"


def test_shards_split_the_problems_and_merge_back(tmp_path):
    from kvpop_lab.peers.runfiles import merge_runs, parse_shard, shard_rows

    assert parse_shard(None) == (0, 1) and parse_shard("2/3") == (2, 3)
    for bad in ("3/3", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    rows = [{"index": i} for i in range(7)]
    shards = [shard_rows(rows, (i, 3)) for i in range(3)]
    assert [[r["index"] for r in s] for s in shards] == [[0, 3, 6], [1, 4], [2, 5]]
    parts = []
    for i, shard in enumerate(shards):
        part = tmp_path / f"s{i}"
        part.mkdir()
        (part / "meta.json").write_text(json.dumps({"argv": [f"shard{i}"], "commit": "c", "date": "d"}))
        write_jsonl(part / "knorm_cr88.jsonl", [dict(r, seed=100 + r["index"]) for r in shard])
        parts.append(part)
    (parts[1] / "knorm_cr88.jsonl").write_text((parts[1] / "knorm_cr88.jsonl").read_text() + '{"index": 7, "se')
    assert merge_runs(parts, tmp_path / "all") == {"knorm_cr88": 7}  # the cut last line is dropped
    merged = read_jsonl(tmp_path / "all" / "knorm_cr88.jsonl")
    assert [r["index"] for r in merged] == list(range(7)) and merged[4]["seed"] == 104
    meta = json.loads((tmp_path / "all" / "meta.json").read_text())
    assert meta["commit"] == "c" and meta["shards"] == [["shard0"], ["shard1"], ["shard2"]]
    assert score.common_prefix([{r["index"]: r for r in merged}]) == 7
    with pytest.raises(ValueError, match="two shards"):
        merge_runs([parts[0], parts[0]], tmp_path / "twice")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        merge_runs([tmp_path], tmp_path / "none")


def test_device_lock_turns():
    """A measurement holding the device keeps a sharer's next generation out until it releases, and waits for a
    running generation to end; no folder: no lock."""
    import tempfile
    import threading
    import time

    from kvpop_lab.peers.device_lock import DeviceLock

    with tempfile.TemporaryDirectory() as folder:
        measure, sharer = DeviceLock(folder), DeviceLock(folder)
        entered = threading.Event()

        def generation():
            with sharer.shared():
                entered.set()

        measure.acquire()
        measure.acquire()  # held already: no second wait
        t = threading.Thread(target=generation)
        t.start()
        assert not entered.wait(0.3)  # the gate is closed
        measure.release()
        assert entered.wait(5)
        t.join()
        measure.release()  # not held: nothing to do

        running, done = threading.Event(), threading.Event()

        def long_generation():
            with sharer.shared():
                running.set()
                time.sleep(0.4)
                done.set()  # still holding the device

        t = threading.Thread(target=long_generation)
        t.start()
        assert running.wait(5)
        with measure.exclusive():
            assert done.is_set()  # the exclusive turn began after the running generation ended
        t.join()
    free = DeviceLock(None)
    with free.shared(), free.exclusive():
        free.acquire()
        free.release()


def test_speed_rows_and_budgets():
    from kvpop_hf.policies import parse_budgets
    from kvpop_lab.peers.speed_rows import budget_entries, parse_rows

    assert parse_rows(["32768x1", "131072X1", "32768x8"]) == [(32768, 1), (131072, 1), (32768, 8)]
    for bad, match in ((["32k"], "CONTEXTxBATCH"), (["0x1"], ">= 1"), (["8x1", "8x1"], "twice"), ([], "no rows")):
        with pytest.raises(ValueError, match=match):
            parse_rows(bad)
    for context in (32768, 131072, 4096):
        B = parse_budgets(compression="0.88", length=context, sinks=4, window=64)[0].B
        assert budget_entries(0.88, context) == B
    assert budget_entries(0.88, 32768) == 3932 and budget_entries(0.88, 131072) == 15729
    with pytest.raises(ValueError, match="must be in"):
        budget_entries(1.0, 100)


def test_speed_table_ratios_and_missing_rows(tmp_path):
    from kvpop_lab.peers import speed_table

    kv = {"context": 64, "batch": 1, "B": 8, "filled": "prefill", "prefill_s": 2.0, "decode_ms": 10.0,
          "tokens_per_s": 100.0, "peak_gb": 4.0, "decode_peak_gb": 2.0, "command": "a", "path": "p"}
    runs = {"kvpop": [kv, dict(kv, batch=4, prefill_s=None, filled="in place")],
            "kvpress": [dict(kv, decode_ms=30.0, peak_gb=8.0, entries_end=8)],
            "static": [dict(kv, B=64, decode_ms=5.0), dict(kv, batch=4, decode_ms="OOM", peak_gb="OOM")]}
    lines = speed_table.table(runs, [(64, 1), (64, 4)])
    got = {(x["system"], x["batch"]): x for x in lines}
    assert [(x["system"], x["batch"]) for x in lines] == [(s, b) for b in (1, 4) for s in speed_table.SYSTEMS]
    assert got[("kvpress", 1)]["x_decode_ms"] == 3.0 and got[("kvpress", 1)]["x_peak_gb"] == 2.0
    assert got[("static", 1)]["x_decode_ms"] == 0.5 and got[("kvpop", 1)]["x_decode_ms"] == 1.0
    assert got[("kvpress", 4)]["decode_ms"] == speed_table.NOT_RUN
    assert got[("static", 4)]["decode_ms"] == got[("static", 4)]["prefill_s"] == "OOM"
    assert got[("static", 4)]["x_decode_ms"] == ""
    assert got[("kvpop", 4)]["prefill_s"] == "" and got[("kvpop", 4)]["x_prefill_s"] == ""
    for system in speed_table.SYSTEMS:
        (tmp_path / f"{system}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs[system]))
    out = tmp_path / "speed.csv"
    assert speed_table.main([*(x for s in speed_table.SYSTEMS for x in (f"--{s}", str(tmp_path / f"{s}.jsonl"))),
                             "--rows", "64x1", "64x4", "--out", str(out), "--markdown", str(tmp_path / "s.md")]) == 0
    import csv

    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == speed_table.COLUMNS and len(rows) == 6
    assert "| kvpress | 64 | 1 |" in (tmp_path / "s.md").read_text()


def test_plot_draws_the_quality_table_and_the_speed_table(tmp_path):
    """The figure of results/peers: the shipped quality CSV and a speed table with a row that did not run."""
    import csv

    from kvpop_lab.peers import plot, speed_table

    lines = speed_table.table({"kvpop": [{"context": 32768, "batch": 1, "decode_ms": 6.0, "prefill_s": 3.0,
                                          "peak_gb": 2.0}],
                               "kvpress": [{"context": 32768, "batch": 1, "decode_ms": 30.0, "prefill_s": 4.0,
                                            "peak_gb": 9.0}]},
                              [(32768, 1), (131072, 1)])
    speed = tmp_path / "speed.csv"
    with open(speed, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=speed_table.COLUMNS)
        w.writeheader()
        w.writerows({c: line.get(c, "") for c in speed_table.COLUMNS} for line in lines)
    out = tmp_path / "peers.png"
    assert plot.main(["--quality", str(ROOT / "results" / "peers" / "quality_4k.csv"), "--speed", str(speed),
                      "--out", str(out), "--chance", "0.1"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_refuses_a_table_without_exact_match(tmp_path):
    from kvpop_lab.peers import plot

    empty = tmp_path / "q.csv"
    empty.write_text("library,policy,mode,compression,B,n,em,se\n")
    with pytest.raises(SystemExit):
        plot.main(["--quality", str(empty), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit):
        plot.main(["--quality", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "x.png")])
