"""benchmarks/split_model_generation.py end to end on a tiny model with both halves on the CPU: the split
run (accelerate dispatch) gives the single-device tokens, and every layer's cache buffers and scorer copy
sit on that layer's device."""

from __future__ import annotations

import csv

import pytest

from kvpop_lab.bench import split_model_generation

pytestmark = pytest.mark.tier("scripts")


def test_split_run_matches_one_device(tmp_path):
    prefix = tmp_path / "split"
    rc = split_model_generation.main(["--devices", "cpu", "cpu", "--shape", "tiny", "--context", "120",
                                      "--prefill-chunk", "50", "--new-tokens", "10", "--warmup", "2",
                                      "--sinks", "2", "--window", "8", "--topk", "14", "--out-prefix", str(prefix)])
    assert rc == 0
    rows = list(csv.DictReader(line for line in prefix.with_suffix(".csv").read_text().splitlines()
                               if not line.startswith("#")))
    assert [r["placement"] for r in rows] == ["one device (cpu)", "split cpu + cpu"]
    for r in rows:
        assert r["same_tokens_as_one_device_eager"] == "True"
        assert r["buffers_on_layer_device"] == "True" and r["scorer_on_layer_device"] == "True"
    text = prefix.with_suffix(".md").read_text()
    assert "commit" in text and "B = 2+8+14;" in text


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(ValueError, match="--warmup"):
        split_model_generation.main(["--devices", "cpu", "cpu", "--new-tokens", "4", "--warmup", "4"])
    with pytest.raises(ValueError, match="--context"):
        split_model_generation.main(["--devices", "cpu", "cpu", "--context", "0"])
