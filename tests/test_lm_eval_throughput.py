"""benchmarks/lm_eval_throughput.py on CPU with a tiny shape: every run times lm-eval's generate_until on the same
requests, decodes every new token, and the results file records the command, commit and rows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("scripts")

pytest.importorskip("lm_eval")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("extra", [[], ["--no-compile"], ["--batching", "continuous"]])
def test_tiny_run_writes_a_row_per_run(tmp_path, extra):
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "benchmarks/lm_eval_throughput.py", "--device", "cpu", "--shape", "tiny",
                        "--batch", "2", "--context", "128", "--new-tokens", "4", "--policies", "kvpop,knorm",
                        "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert [row["run"] for row in res["rows"]] == ["kvpop:kvpop", "kvpop:knorm", "hf"]
    assert all(row["new_words_per_row"] == [4, 4] and row["seconds"] > 0 for row in res["rows"])
    assert [row["compile"] for row in res["rows"]] == ([False] * 3 if "--no-compile" in extra else [True, True, False])
    batching = "continuous" if "continuous" in extra else "static"
    assert [row["model_args"].get("batching") for row in res["rows"]] == [batching, batching, None]
    assert res["command"].startswith("python benchmarks/lm_eval_throughput.py") and res["commit"]
    assert "| hf |" in (out / "result.md").read_text()
