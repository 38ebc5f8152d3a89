"""StreamingLLM+ (sinks + window, k = 0, model LoRA-distilled at the budget): retrofit, merged save and kvpop-eval."""

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from kvpop_hf import KVpopCache
from kvpop_lab.testbed import build_tokenizer
from kvpop_lab.testbed.evaluate import build_parser, main, plan_from_args
from kvpop_hf.trainer import KVpopTrainingArguments

from kvpop_hf.cli import retrofit

pytestmark = pytest.mark.tier("scripts")

LENGTH, SINKS, B = 256, 4, 32


def _teacher(root: Path, trained: bool = False) -> Path:
    """A tiny Qwen3 over the testbed vocabulary (``trained``: briefly, so that token accuracy is not zero)."""
    tok = build_tokenizer()
    if trained:
        from test_evaluate import _tiny_trained_model

        model = _tiny_trained_model(tok, steps=40)
    else:
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    return root / "teacher"


def _eval(teacher, ckpts, out):
    argv = ["--model", str(teacher), "--out", str(out), "--n", "2", "--length", str(LENGTH), "--families",
            "reasoning", "--sinks", str(SINKS), "--window", "16", "--budgets", str(B),
            "--policies", "streaming,streaming_plus", "--checkpoints-dir", str(ckpts), "--no-progress"]
    assert main(argv) == 0
    with open(out / "results.csv") as fh:
        rows = {r["policy"]: r for r in csv.DictReader(fh)}
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return rows, outputs


def test_lora_distillation_at_window_budget_then_eval(tmp_path):
    teacher = _teacher(tmp_path)
    ck = tmp_path / "ckpts" / f"streaming_plus_b{B}"
    trainer = retrofit.train([
        "--model", str(teacher), "--dataset", "testbed:reasoning", "--seq_len", str(LENGTH), "--sinks", str(SINKS),
        "--window", str(B - SINKS), "--topk", "0", "--scorer", "streaming", "--lora_rank", "4", "--merge_lora", "True",
        "--output_dir", str(ck), "--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
        "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "True",
        "--disable_tqdm", "True"])
    logs = [e for e in trainer.state.log_history if "distill_loss" in e]
    assert logs and all("boundary_loss" not in e for e in logs)  # no scorer to train: no target pass
    assert not (ck / "adapter_config.json").exists() and (ck / "model.safetensors").is_file()
    student = AutoModelForCausalLM.from_pretrained(ck)
    base = AutoModelForCausalLM.from_pretrained(teacher)
    sd, bd = student.state_dict(), base.state_dict()
    assert set(sd) == set(bd)  # merged: plain weights, no LoRA modules, no scorer
    assert not torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], bd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sd["model.layers.0.mlp.up_proj.weight"], bd["model.layers.0.mlp.up_proj.weight"])
    cfg = KVpopCache.from_pretrained(ck, student.config).kvpop_config
    assert (cfg.sinks, cfg.window, cfg.topk, cfg.scorer) == (SINKS, B - SINKS, 0, "streaming")

    rows, _ = _eval(teacher, tmp_path / "ckpts", tmp_path / "out")
    assert (rows["streaming"]["window"], rows["streaming"]["topk"]) == ("16", str(B - SINKS - 16))
    sp = rows["streaming_plus"]
    assert (sp["budget"], sp["sinks"], sp["window"], sp["topk"]) == (str(B), str(SINKS), str(B - SINKS), "0")
    assert 0.0 <= float(sp["token_acc"]) <= 1.0 and sp["em"] != ""
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert [r["checkpoint"] for r in meta["runs"] if r["policy"] == "streaming_plus"] == [str(ck)]


def test_streaming_plus_with_the_teacher_weights_equals_streaming(tmp_path):
    """Same weights: sinks + window of B - s keeps exactly what streaming with w + k keeps."""
    teacher = _teacher(tmp_path, trained=True)
    ck = tmp_path / "ckpts" / "streaming_plus"
    model = AutoModelForCausalLM.from_pretrained(teacher)
    model.save_pretrained(ck)
    KVpopCache(model.config, sinks=SINKS, window=B - SINKS, topk=0, scorer="streaming").save_pretrained(ck)
    rows, outputs = _eval(teacher, tmp_path / "ckpts", tmp_path / "out")
    acc = {p: [o["token_acc"] for o in outputs if o["policy"] == p] for p in ("streaming", "streaming_plus")}
    assert acc["streaming"] == acc["streaming_plus"] and max(acc["streaming"]) > 0
    assert rows["streaming"]["em"] == rows["streaming_plus"]["em"]


def test_unsupported_combinations(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], sinks=2, window=5)
    with pytest.raises(ValueError, match="no parameters"):
        KVpopTrainingArguments(scorer="streaming", topk=0, train_backbone=False, **base)
    with pytest.raises(ValueError, match="no parameters"):
        KVpopTrainingArguments(scorer="streaming", topk=0, distill_weight=0.0, **base)
    with pytest.raises(ValueError, match="nothing to choose"):
        KVpopTrainingArguments(scorer="mlstm", topk=0, **base)
    with pytest.raises(ValueError, match="fixed one"):
        KVpopTrainingArguments(scorer="tova", topk=4, **base)
    KVpopTrainingArguments(scorer="knorm", topk=4, **base)  # fixed scorer with long-range slots: fine

    teacher = _teacher(tmp_path)
    KVpopCache(AutoModelForCausalLM.from_pretrained(teacher).config, sinks=SINKS, window=B - SINKS, topk=0,
               scorer="streaming").save_pretrained(tmp_path / "ckpts" / "streaming_plus")  # scorer files, no model
    args = build_parser().parse_args(["--model", str(teacher), "--out", str(tmp_path / "o"), "--length", str(LENGTH),
                                      "--n", "1", "--families", "reasoning", "--sinks", str(SINKS), "--window", "16",
                                      "--budgets", str(B), "--policies", "streaming_plus",
                                      "--checkpoints-dir", str(tmp_path / "ckpts")])
    with pytest.raises(ValueError, match="no LoRA adapter"):
        plan_from_args(args)


def test_lora_adapter_folder_evaluates_as_its_merged_model(tmp_path):
    """A student saved as a PEFT adapter (no --merge_lora) is an own-model checkpoint of kvpop-eval: its config
    comes from the adapter's base model, it loads with the adapter applied, and it evaluates as the same adapter
    merged into the weights by peft and saved as a plain model directory (float32)."""
    import shutil

    from peft import PeftModel

    from kvpop_lab.testbed.models import holds_model, load_model, model_config

    teacher = _teacher(tmp_path)
    adapter = tmp_path / "adapter" / f"streaming_plus_b{B}"
    merged = tmp_path / "merged" / f"streaming_plus_b{B}"
    retrofit.main(["--model", str(teacher), "--dataset", "testbed:reasoning", "--seq_len", str(LENGTH), "--sinks",
                   str(SINKS), "--window", str(B - SINKS), "--topk", "0", "--scorer", "streaming", "--lora_rank",
                   "4", "--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
                   "--report_to", "none", "--save_strategy", "no", "--use_cpu", "True", "--disable_tqdm", "True",
                   "--output_dir", str(adapter)])
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(teacher)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(merged)
    for name in ("kvpop_config.json", "kvpop_scorer.safetensors"):
        if (adapter / name).is_file():
            shutil.copy(adapter / name, merged / name)
    assert holds_model(adapter) and holds_model(merged) and not holds_model(tmp_path)
    assert model_config(adapter).to_dict() == model_config(teacher).to_dict()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        a = load_model(str(adapter), torch.float32, "cpu")(ids).logits
        m = load_model(str(merged), torch.float32, "cpu")(ids).logits
        t = load_model(str(teacher), torch.float32, "cpu")(ids).logits
    assert not torch.allclose(a, t, atol=1e-4)  # the adapter is applied
    torch.testing.assert_close(a, m, atol=1e-4, rtol=1e-4)
    rows_a, out_a = _eval(teacher, tmp_path / "adapter", tmp_path / "out_a")
    rows_m, out_m = _eval(teacher, tmp_path / "merged", tmp_path / "out_m")
    assert [(o["policy"], o["generated"]) for o in out_a] == [(o["policy"], o["generated"]) for o in out_m]
    assert rows_a["streaming_plus"]["token_acc"] == rows_m["streaming_plus"]["token_acc"]
