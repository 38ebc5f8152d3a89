"""The wheel carries what an installed kvpop-hf needs at run time (the model card template); the GPU
run scripts parse."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_model_card_template(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path)], capture_output=True, text=True)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build a wheel here: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr
    wheel = next(tmp_path.glob("kvpop_hf-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvpop_hf/trainer/model_card_template.md" in names
    assert "kvpop_hf/decode_eviction.py" in names


def test_core_does_not_import_the_testbed_or_benchmark_helpers():
    """``import kvpop_hf`` and using a KVpopCache load the library core only (no testbed, timing, provenance)."""
    code = ("import sys, kvpop_hf, kvpop_hf.cache, kvpop_hf.layer, kvpop_hf.attention, kvpop_hf.flex_mask; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvpop_hf.testbed', 'kvpop_hf.utils.timing', "
            "'kvpop_hf.utils.provenance', 'kvpop_hf.trainer'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_gpu_scripts_parse():
    """The GPU run scripts (benchmarks/gpu/*.sh) are only run on a GPU machine: at least their syntax is checked
    here, so a typo does not cost a device call."""
    scripts = sorted((ROOT / "benchmarks").rglob("*.sh"))
    assert len(scripts) >= 10
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
