"""The quick-start demo (examples/generate.py), run as a user runs it, on the committed 4k testbed checkpoints: the
LoRA student with its learned cache by default (answering as the dense teacher with a DynamicCache does),
heuristics by name on the teacher, clear errors for conflicting or unusable flags (before any work)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
TEACHER, STUDENT = ROOT / "checkpoints/testbed-4k-teacher", ROOT / "checkpoints/testbed-4k-kvpop-cr88"


def demo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/generate.py", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=900)


def test_demo_uses_the_learned_student_and_answers():
    res = demo("--max-new-tokens", "120")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "student: " in out and "scorer learned mlstm from" in out
    assert "entries stored per head:     min 492 / max 492" in out  # a 919-token prompt: the cache evicted
    assert out.count("-> correct") == 2  # the student at B = 492 answers like the teacher's full cache


def test_demo_heuristic_by_name():
    res = demo("--scorer", "streaming", "--max-new-tokens", "8", "--no-compare")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "scorer 'streaming'" in res.stdout


@pytest.mark.parametrize("argv, msg", [
    (["--scorer", "knorm", "--scorer-checkpoint", "checkpoints/testbed-4k-kvpop-cr88"], "not both"),
    (["--scorer-checkpoint", "no/such/folder"], "no kvpop_config.json"),
    (["--random-model", "--scorer-checkpoint", "checkpoints/testbed-4k-kvpop-cr88"], "needs the trained model"),
    (["--prompt-len", "2000", "--no-compare"], "1024, 4096"),
])
def test_demo_rejects_bad_flags(argv, msg):
    res = demo(*argv)
    assert res.returncode != 0 and msg in res.stderr, res.stderr[-2000:]


def test_shipped_problems_match_the_generator():
    """examples/testbed_problems.json is what `python -m kvpop_lab.testbed.example_problems` writes."""
    from kvpop_lab.testbed.example_problems import DEFAULT_OUT, example_problems

    assert json.loads(DEFAULT_OUT.read_text()) == example_problems()
