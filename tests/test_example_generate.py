"""The quick-start demo (examples/generate.py) on the committed 4k testbed checkpoints: the LoRA student with its
learned cache by default (answering as the dense teacher with a DynamicCache does), heuristics by name on the
teacher, clear errors for conflicting or unusable scorer flags (before any work)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kvpop_example_generate", ROOT / "examples" / "generate.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

needs_ckpt = pytest.mark.skipif(not demo.has_checkpoint(demo.DEFAULT_CHECKPOINT)
                                or not (demo.DEFAULT_SCORER_CHECKPOINT / "kvpop_config.json").is_file(),
                                reason="testbed checkpoints not committed")


@needs_ckpt
def test_demo_uses_the_learned_student_and_answers(capsys):
    assert demo.main(["--max-new-tokens", "120"]) == 0
    out = capsys.readouterr().out
    assert "student: " in out and "scorer learned mlstm from" in out
    assert "entries stored per head:     min 492 / max 492" in out  # a 919-token prompt: the cache evicted
    assert out.count("-> correct") == 2  # seed 0: the student at B = 492 answers like the teacher's full cache


@needs_ckpt
def test_demo_heuristic_by_name(capsys):
    assert demo.main(["--scorer", "streaming", "--max-new-tokens", "8", "--no-compare"]) == 0
    assert "scorer 'streaming'" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--scorer", "knorm", "--scorer-checkpoint", "checkpoints/testbed-4k-kvpop-cr88"], "not both"),
    (["--scorer-checkpoint", "no/such/folder"], "no kvpop_config.json"),
    (["--random-model", "--scorer-checkpoint", "checkpoints/testbed-4k-kvpop-cr88"], "needs the trained model"),
])
def test_demo_rejects_bad_scorer_flags(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        demo.main(argv)
