"""kvpop_hf.compile_cache: a second process compiles nothing that the first one compiled, through the shared
directory and through the portable bundle alone (torch's FX-graph cache counters, CPU inductor)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpop_hf.compile_cache import ARTIFACTS_FILE, enable_compile_cache

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from kvpop_hf.compile_cache import enable_compile_cache, save_compile_cache
state = enable_compile_cache(sys.argv[1])
f = torch.compile(lambda x: (x.sin() * 2).cos() + x.exp().mean())
f(torch.randn(64))
saved = save_compile_cache(sys.argv[1]) if sys.argv[2] == "save" else None
print(json.dumps({"loaded": state["loaded"], "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "saved": saved is not None}))
"""


def _run(directory, mode):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(directory), mode], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.tier("scripts")  # another process or the command line
def test_second_process_reuses_the_first_ones_compilation(tmp_path):
    shared = tmp_path / "shared"
    first = _run(shared, "save")
    assert first["miss"] >= 1 and first["hit"] == 0 and first["saved"] and first["loaded"] == 0
    second = _run(shared, "none")  # same machine: the on-disk caches
    assert second["hit"] >= 1 and second["miss"] == 0
    fresh = tmp_path / "fresh"  # another machine: only the bundle travels
    fresh.mkdir()
    shutil.copy(shared / ARTIFACTS_FILE, fresh / ARTIFACTS_FILE)
    third = _run(fresh, "none")
    assert third["loaded"] >= 1 and third["hit"] >= 1 and third["miss"] == 0


def test_a_file_is_not_a_cache_directory(tmp_path):
    path = tmp_path / "f"
    path.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        enable_compile_cache(path)
