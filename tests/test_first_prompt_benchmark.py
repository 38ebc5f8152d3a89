"""kvpop_lab.bench.first_prompt at a tiny shape on CPU: two prompts per fresh process, one row each, with the
provenance columns; bad flags are refused before any work."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.tier("scripts")


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpop_lab.bench.first_prompt", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_rows_of_a_tiny_run(tmp_path):
    out = tmp_path / "fp.csv"
    res = run("--device", "cpu", "--shape", "tiny", "--contexts", "200", "--paths", "default", "static",
              "--processes", "cold", "--prefill-chunk", "64", "--topk", "16", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader(open(out)))
    assert [(r["path"], r["prompt"]) for r in rows] == [("default", "1"), ("default", "2"), ("static", "1"),
                                                         ("static", "2")]
    assert all(r["status"] == "ok" and float(r["prefill_s"]) > 0 and r["device"] == "cpu" for r in rows)
    assert all(r["command"].startswith("python -m kvpop_lab.bench.first_prompt") and r["date"] for r in rows)


def test_bad_flags_are_refused(tmp_path):
    res = run("--device", "cpu", "--prefill-chunk", "0", "--out", str(tmp_path / "x.csv"))
    assert res.returncode != 0 and "--prefill-chunk" in res.stderr
    assert not (tmp_path / "x.csv").exists()
