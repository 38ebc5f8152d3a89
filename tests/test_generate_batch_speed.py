"""benchmarks/generate_batch_speed.py on the tiny shape (CPU): one row per mode with the CSV's columns, and every
mode's requested tokens counted."""

import csv

import pytest

from kvpop_lab.bench import generate_batch_speed

pytestmark = pytest.mark.tier("scripts")


def test_tiny_rows(tmp_path):
    prefix = tmp_path / "gb"
    argv = ["--shape", "tiny", "--sinks", "2", "--window", "8", "--topk", "6", "--requests", "5", "--prompt-min", "4",
            "--prompt-max", "30", "--new-min", "2", "--new-max", "9", "--rows", "2", "3", "--static-batch", "2",
            "--staticcache-batch", "2", "--prefill-chunk", "8", "--pass-prompts", "2", "--pass-n", "3",
            "--pass-new", "4", "--pass-rows", "4", "--out-prefix", str(prefix)]
    assert generate_batch_speed.main(argv) == 0
    with open(prefix.with_suffix(".csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == generate_batch_speed.COLUMNS
    assert [(r["mode"], r["rows"]) for r in rows] == [("generate_batch", "2"), ("generate_batch", "3"),
                                                      ("static_kvpop", "2"), ("static_cache", "2"),
                                                      ("pass_fork", "4"), ("pass_prefills", "4")]
    requested = {r["mode"]: int(r["tokens"]) for r in rows}
    assert requested["generate_batch"] == requested["static_kvpop"] == requested["static_cache"]
    assert requested["pass_fork"] == requested["pass_prefills"] == 2 * 3 * 4
    assert int(rows[2]["decoded_tokens"]) >= int(rows[2]["tokens"])
    assert all(r["device"] == "cpu" and r["commit"] and r["command"].startswith("python benchmarks/") for r in rows)
    assert "generate_batch" in prefix.with_suffix(".md").read_text()
