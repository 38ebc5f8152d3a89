"""benchmarks/training_scale.py end to end on the tiny shape (CPU): every trainer row, the profiled step's
component split, the allocator-history replay, the CSV's exact columns, merging of two invocations, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvpop_lab.bench import training_scale

pytestmark = pytest.mark.tier("scripts")

COMMON = ["--shape", "tiny", "--device", "cpu", "--steps", "1", "--window", "16", "--lora-rank", "4"]


def read(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_every_row_runs_and_a_second_invocation_adds_its_rows(tmp_path):
    prefix = tmp_path / "scale"
    rows = "lora_sft,lora_distill,kvpop_scorer_only:mlstm,kvpop_distill:mlp"
    training_scale.main(COMMON + ["--seq-lens", "320", "--rows", rows, "--profile", "--out-prefix", str(prefix)])
    with open(prefix.with_suffix(".csv")) as fh:
        assert fh.readline().strip() == "trainer,scorer,seq_len,step_s,tokens_per_s,peak_gb"
    got = read(prefix.with_suffix(".csv"))
    assert {(r["trainer"], r["scorer"]) for r in got} == {("lora_sft", "none"), ("lora_distill", "none"),
                                                           ("kvpop_scorer_only", "mlstm"), ("kvpop_distill", "mlp")}
    assert all(float(r["step_s"]) > 0 and float(r["tokens_per_s"]) > 0 for r in got)
    comps = {(r["trainer"], r["scorer"]): r for r in read(str(prefix) + "_components.csv")}
    kd = comps[("kvpop_distill", "mlp")]
    assert float(kd["teacher_forward"]) > 0 and float(kd["sparse_attention"]) > 0 and float(kd["target_pass"]) > 0
    assert float(comps[("lora_sft", "none")]["sparse_attention"]) == 0
    # a second invocation at another length adds its row; the same key is replaced, not duplicated
    training_scale.main(COMMON + ["--rows", "kvpop_distill:mlstm@384,lora_sft@320", "--out-prefix", str(prefix)])
    got = read(prefix.with_suffix(".csv"))
    assert len(got) == 5 and sum(r["trainer"] == "lora_sft" for r in got) == 1
    runs = json.loads(Path(str(prefix) + "_runs.json").read_text())
    assert len(runs) == 2 and ["kvpop_distill", "mlstm", 384] in runs[1]["rows"]
    md = prefix.with_suffix(".md").read_text()
    assert "| kvpop_distill | mlstm | 384 |" in md and "## Invocations" in md


def test_peak_breakdown_replays_the_allocator_history():
    frames = [{"filename": "/x/kvpop_hf/scorers/base.py", "line": 84, "name": "headwise_linear"}]
    other = [{"filename": "/x/transformers/models/qwen3/modeling_qwen3.py", "line": 61, "name": "forward"}]
    trace = [dict(action="alloc", addr=1, size=4_000_000_000, frames=frames),
             dict(action="alloc", addr=2, size=1_000_000_000, frames=other),
             dict(action="free_requested", addr=1, size=4_000_000_000, frames=frames),
             dict(action="alloc", addr=3, size=2_000_000_000, frames=other)]
    peak, groups = training_scale.peak_breakdown({"device_traces": [trace]})
    assert peak == pytest.approx(5.0)
    assert groups[0] == ("kvpop_hf/scorers/base.py:84 headwise_linear", pytest.approx(4.0))


@pytest.mark.parametrize("argv, match", [
    (["--rows", "nope"], "unknown trainer"),
    (["--rows", "kvpop_distill"], "needs a scorer"),
    (["--rows", "lora_sft:mlp"], "has no scorer"),
    (["--rows", "lora_sft@abc"], "sequence length"),
    (["--seq-lens", "1k"], "comma-separated list of integers"),
    (["--seq-lens", "64", "--window", "64"], "no long-range slot"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        training_scale.main(COMMON + argv + ["--out-prefix", str(tmp_path / "x")])
    assert not (tmp_path / "x.csv").exists()
