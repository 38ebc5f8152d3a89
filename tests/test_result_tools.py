"""The small result tools: benchmarks/merge_eval_runs.py, eval_table.py and plot_probe_curves.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvpop_lab.bench import eval_table
from kvpop_lab.bench import merge_eval_runs
from kvpop_lab.bench import plot_probe_curves

pytestmark = pytest.mark.tier("scripts")

COLS = ["policy", "budget", "cr", "sinks", "window", "topk", "family", "em", "token_acc", "lookup_acc", "n",
        "n_target_tokens"]
META = {"model": "m", "length": 1024, "n_per_family": 2, "seeds": {"base": 7}, "families": ["reasoning"],
        "knobs": {}}


def _run(folder: Path, rows, **meta_changes):
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({**META, **meta_changes}))
    with open(folder / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLS})


def _r(policy, budget, cr, em, acc=0.9, lk=0.5):
    return {"policy": policy, "budget": budget, "cr": cr, "family": "reasoning", "em": em, "token_acc": acc,
            "lookup_acc": lk, "n": 2}


def test_merge_keeps_first_dense_and_all_budgets(tmp_path):
    _run(tmp_path / "a", [_r("dense", "full", 0, 1.0, 1.0, 1.0), _r("kvpop", "123", 0.88, 0.0)])
    _run(tmp_path / "b", [_r("dense", "full", 0, 0.5), _r("kvpop", "512", 0.5, 1.0)])
    merge_eval_runs.main(["--out", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")])
    rows = list(csv.DictReader(open(tmp_path / "m" / "merged_results.csv")))
    assert [(r["policy"], r["budget"]) for r in rows] == [("dense", "full"), ("kvpop", "512"), ("kvpop", "123")]
    assert float(rows[0]["em"]) == 1.0  # the first run's dense row wins
    table = (tmp_path / "m" / "merged_table.md").read_text()
    assert "| kvpop | 512 | 0.500 | 1.000 |" in table
    assert (tmp_path / "m" / "merged_quality_vs_budget.png").stat().st_size > 1000


def test_merge_refuses_runs_on_different_problems(tmp_path):
    _run(tmp_path / "a", [_r("dense", "full", 0, 1.0)])
    _run(tmp_path / "b", [_r("dense", "full", 0, 1.0)], length=2048)
    with pytest.raises(SystemExit, match="length"):
        merge_eval_runs.main(["--out", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")])


def test_probe_curves_from_log_and_manifest(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("step 1 loss 7\rtrain: 5%\rprobe step 250: {\"step\": 250, \"lookup_acc\": 0.1, \"token_acc\": 0.5}\n"
                   "probe step 500: {\"step\": 500, \"lookup_acc\": 0.9, \"token_acc\": 0.95}\n")
    man = tmp_path / "manifest.json"
    man.write_text(json.dumps({"probe_curve": [{"step": 3, "lookup_acc": 0.2, "token_acc": 0.3}]}))
    assert [r["step"] for r in plot_probe_curves.read_curve(str(log))] == [250, 500]
    out = tmp_path / "p.png"
    plot_probe_curves.main(["--out", str(out), f"a={log}", f"b={man}"])
    assert out.stat().st_size > 1000
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert [(r["run"], r["step"], r["lookup_acc"]) for r in rows] == [("a", "250", "0.1"), ("a", "500", "0.9"),
                                                                      ("b", "3", "0.2")]
    with pytest.raises(SystemExit, match="no probe records"):
        empty = tmp_path / "e.log"
        empty.write_text("nothing\n")
        plot_probe_curves.main(["--out", str(out), f"e={empty}"])


def test_eval_table_first_folder_wins_and_suffix_keeps_both(tmp_path, capsys):
    _run(tmp_path / "a", [_r("dense", "full", 0.0, 1.0), _r("kvpop", 492, 0.88, 0.5)])
    _run(tmp_path / "b", [_r("dense", "full", 0.0, 0.5), _r("kvpop", 492, 0.88, 1.0), _r("tova", 492, 0.88, 0.0)])
    out = tmp_path / "t.md"
    eval_table.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    rows = [line.split(" | ") for line in out.read_text().splitlines()[2:]]
    assert [(r[0].strip("| "), r[2]) for r in rows] == [("dense", "1.000"), ("kvpop", "0.500"), ("tova", "0.000")]
    eval_table.main([str(tmp_path / "a"), f"{tmp_path / 'b'}@_long", "--out", str(out)])
    rows = [line.split(" | ") for line in out.read_text().splitlines()[2:]]
    assert [(r[0].strip("| "), r[2]) for r in rows] == [("dense", "1.000"), ("kvpop", "0.500"),
                                                        ("kvpop_long", "1.000"), ("tova_long", "0.000")]


def test_eval_table_family_filter_and_recall_column(tmp_path):
    rows = [_r("dense", "full", 0.0, 1.0), _r("kvpop", 492, 0.88, 0.5),
            {**_r("dense", "full", 0.0, 0.9), "family": "vt"}, {**_r("kvpop", 492, 0.88, 0.25), "family": "vt"}]
    _run(tmp_path / "a", rows)
    with open(tmp_path / "a" / "recall_per_layer.csv", "w") as fh:
        fh.write("policy,budget,cr,layer,head,oracle_recall,n_problems\n"
                 "kvpop,492,0.88,0,0,0.5,8\nkvpop,492,0.88,0,1,0.7,8\n")
    out = tmp_path / "t.md"
    with pytest.raises(SystemExit, match="several families.*--family"):
        eval_table.main([str(tmp_path / "a"), "--out", str(out)])
    eval_table.main([str(tmp_path / "a"), "--family", "vt", "--out", str(out)])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()[2:]]
    assert [(r[0], r[2], r[7]) for r in rows] == [("dense", "0.900", "–"), ("kvpop", "0.250", "–")]
    eval_table.main([str(tmp_path / "a"), "--family", "reasoning", "--out", str(out)])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()[2:]]
    assert [(r[0], r[2], r[7]) for r in rows] == [("dense", "1.000", "–"), ("kvpop", "0.500", "0.600")]


def test_eval_table_exclude_and_recall_only_for_reasoning(tmp_path):
    rows = [_r("dense", "full", 0.0, 1.0), _r("streaming", 492, 0.88, 0.1), _r("kvpop", 492, 0.88, 0.5),
            {**_r("kvpop", 492, 0.88, 0.25), "family": "vt", "lookup_acc": "nan"}]
    _run(tmp_path / "a", rows)
    (tmp_path / "a" / "recall_per_layer.csv").write_text(
        "policy,budget,cr,layer,head,oracle_recall,n_problems\nkvpop,492,0.88,0,0,0.5,8\n")
    out = tmp_path / "t.md"
    eval_table.main([f"{tmp_path / 'a'}@_x", "--family", "vt", "--out", str(out)])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()[2:]]
    assert rows == [["kvpop_x", "492", "0.250", "0.306", "2", "0.900", "–", "–"]]
    eval_table.main([f"{tmp_path / 'a'}@_x", "--family", "reasoning", "--exclude", "streaming*", "--out", str(out)])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()[2:]]
    assert [(r[0], r[7]) for r in rows] == [("dense", "–"), ("kvpop_x", "0.500")]
