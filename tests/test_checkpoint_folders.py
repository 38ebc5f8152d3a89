"""Every folder under ``checkpoints/`` is a Hub-layout folder that loads as it is: a fresh interpreter (no laboratory
import, no unpacking step) loads it with ``AutoModelForCausalLM.from_pretrained`` and gets the weights the folder
tracks. The students are peft adapters over the teacher, whose path their ``adapter_config.json`` names relative to
the repository root (run from there, as the README's commands are)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.name for p in (ROOT / "checkpoints").iterdir() if p.is_dir() and (p / "README.md").is_file())

LOAD = """
import json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder)
state = {k: v for k, v in model.state_dict().items()}
import os
if os.path.isfile(os.path.join(folder, "model.safetensors")):
    saved = load_file(os.path.join(folder, "model.safetensors"))
else:  # a peft adapter: its LoRA weights are in the loaded model
    saved = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
             for k, v in load_file(os.path.join(folder, "adapter_model.safetensors")).items()}
loaded = {k: v for k, v in model.named_parameters()}
match = sum(1 for k, v in saved.items() if any(n.endswith(k.split("base_model.model.")[-1]) and torch.equal(p.to(v.dtype), v)
                                                 for n, p in loaded.items()))
print(json.dumps({"class": type(model).__name__, "saved": len(saved), "matched": match,
                  "peft": hasattr(model, "peft_config")}))
"""


def test_the_shipped_folders_are_listed():
    assert FOLDERS == ["testbed-4k-kvpop-cr88", "testbed-4k-kvpop-cr94", "testbed-4k-teacher"]


@pytest.mark.parametrize("name", FOLDERS)
def test_a_checkpoint_folder_loads_as_it_is(name):
    res = subprocess.run([sys.executable, "-c", LOAD, f"checkpoints/{name}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["class"] == "Qwen3ForCausalLM"
    assert out["saved"] > 0 and out["matched"] == out["saved"], out
    assert out["peft"] == (ROOT / "checkpoints" / name / "adapter_config.json").is_file()
