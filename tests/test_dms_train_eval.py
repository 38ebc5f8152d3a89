"""DMS end to end on a tiny model: train_dms.py (LoRA distillation + gate, merged save), DMSCache.from_pretrained,
then kvpop-eval with the "dms" policy and its compression report."""

import csv
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvpop_hf.baselines.dms import DMSCache
from kvpop_lab.testbed.evaluate import main as eval_main
from test_streaming_plus import _teacher

from kvpop_hf.cli import train_dms

pytestmark = pytest.mark.tier("scripts")

LENGTH, SINKS, WINDOW, B = 256, 4, 16, 64


def test_train_then_eval(tmp_path):
    teacher = _teacher(tmp_path)
    ck = tmp_path / "dms_b64"
    trainer = train_dms.train([
        "--model", str(teacher), "--seq_len", str(LENGTH), "--compression", str(1 - B / LENGTH), "--sinks", str(SINKS),
        "--window", str(WINDOW), "--lora_rank", "4", "--output_dir", str(ck), "--max_steps", "3",
        "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none",
        "--save_strategy", "no", "--use_cpu", "True", "--disable_tqdm", "True"])
    logs = [e for e in trainer.state.log_history if "distill_loss" in e]
    assert logs and [e["target_eviction"] for e in logs] == sorted(e["target_eviction"] for e in logs)
    target = 1 - (B - SINKS - WINDOW) / (LENGTH - SINKS - WINDOW)
    assert logs[-1]["target_eviction"] == pytest.approx(target)
    assert (ck / "model.safetensors").is_file() and not (ck / "adapter_config.json").exists()
    student = AutoModelForCausalLM.from_pretrained(ck)
    assert not any("dms_gate" in k or "lora" in k for k in student.state_dict())
    cache = DMSCache.from_pretrained(ck, student.config)
    assert (cache.dms_config.sinks, cache.dms_config.window) == (SINKS, WINDOW)
    assert cache.dms_config.target_eviction == pytest.approx(target)
    assert not torch.equal(cache.gate.bias, torch.full_like(cache.gate.bias, -2.0))  # the gate trained

    out = tmp_path / "out"
    assert eval_main(["--model", str(teacher), "--out", str(out), "--n", "2", "--length", str(LENGTH), "--families",
                      "reasoning", "--sinks", str(SINKS), "--window", str(WINDOW), "--budgets", str(B),
                      "--policies", "dms", "--scorer-checkpoint", f"dms@b{B}={ck}", "--no-progress"]) == 0
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["policy"] for r in rows] == ["dms"] and 0.0 <= float(rows[0]["token_acc"]) <= 1.0
    comp = json.loads((out / "compression.json").read_text())[f"dms@B{B}"]
    assert 0.0 < comp["kept_fraction"] <= 1.0 and comp["n"] == 2
    assert len(comp["eviction_ratio"]) == 2 and len(comp["eviction_ratio"][0]) == 2
    assert len(comp["kept_per_head"]) == 2 and 0 < comp["seen"] <= LENGTH

    from kvpop_hf.baselines.dms import heatmap

    (B_, frac, _), = heatmap.load_maps(out / "compression.json")
    assert B_ == B and all(0.0 <= x < 1.0 for row in frac for x in row)
    assert heatmap.main([str(out / "compression.json"), str(out / "map.png")]) == 0 and (out / "map.png").is_file()
    (out / "other.json").write_text(json.dumps({"kvpop@B64": {}}))
    with pytest.raises(ValueError, match="no dms"):
        heatmap.load_maps(out / "other.json")


def test_bad_compression_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compression"):
        train_dms.main(["--model", "unused", "--compression", "1.5", "--output_dir", str(tmp_path), "--use_cpu", "True"])
