"""benchmarks/hybrid_generate_speed.py on the toy shapes (CPU): every row is measured, and with ``--compile force``
(the eager backend) the ``compiled`` column reports the KVpopCache decode step as one graph, compiled once."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hybrid_generate_speed  # noqa: E402

pytestmark = [pytest.mark.tier("scripts"), pytest.mark.scripts]


@pytest.mark.parametrize("compile_mode", ["off", "force"])
def test_rows_and_compiled_column(tmp_path, compile_mode):
    out = tmp_path / "rows.csv"
    argv = ["--shapes", "tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next", "--contexts", "48", "--new-tokens", "6",
            "--warmup", "2", "--sinks", "2", "--window", "8", "--topk", "8", "--scorer", "knorm",
            "--prefill-chunk", "32", "--device", "cpu", "--compile", compile_mode, "--compile-backend", "eager",
            "--out", str(out)]
    assert hybrid_generate_speed.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["shape"], r["cache"]) for r in rows] == [
        (shape, cache) for shape in ("tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next") for cache in ("default", "kvpop")]
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        if compile_mode == "off" or r["cache"] == "default":  # generate never compiles a DynamicCache
            assert (r["compiled"], r["graphs"], r["graph_breaks"]) == ("no", "0", "0"), r
        else:
            assert (r["compiled"], r["graphs"], r["graph_breaks"]) == ("yes", "1", "0"), r


def test_refuses_a_csv_with_other_columns(tmp_path):
    out = tmp_path / "old.csv"
    out.write_text("shape,cache,context\n")
    with pytest.raises(SystemExit):
        hybrid_generate_speed.main(["--shapes", "tiny-gemma3", "--contexts", "16", "--device", "cpu", "--out", str(out)])
