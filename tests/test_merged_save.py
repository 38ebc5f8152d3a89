"""The merged student is saved in the dtype its source checkpoint records (kvpop_hf/trainer/merged_save.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3Config

from kvpop_hf.trainer.merged_save import merged_dtype, save_weights_as, source_dtype

pytestmark = pytest.mark.tier("unit")



def _model(tied: bool):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg)


def _file_dtypes(d: Path) -> set[str]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {str(f.get_tensor(k).dtype) for k in f.keys()}


@pytest.mark.parametrize("tied", [False, True])
def test_cast_on_save_keeps_the_model_and_its_ties(tmp_path, tied):
    model = _model(tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_weights_as(model, tmp_path / "m", torch.bfloat16)
    assert _file_dtypes(tmp_path / "m") == {"torch.bfloat16"}
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.float32 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, before[k].to(torch.bfloat16).float(), rtol=0, atol=0)
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert source_dtype(str(tmp_path / "m")) == torch.bfloat16


def test_merged_dtype_choices(tmp_path):
    model = _model(False)
    model.save_pretrained(tmp_path / "f32")
    assert merged_dtype("source", str(tmp_path / "f32")) == torch.float32
    assert merged_dtype("bfloat16", str(tmp_path / "f32")) == torch.bfloat16
    with pytest.raises(ValueError, match="--merged_dtype"):
        merged_dtype("half", str(tmp_path / "f32"))


def test_retrofit_refuses_a_bad_merged_dtype_before_training(tmp_path):
    from kvpop_hf.cli import retrofit

    model = _model(False)
    model.save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match="--merged_dtype"):
        retrofit.main(["--model", str(tmp_path / "t"), "--dataset", "testbed:reasoning", "--merged_dtype", "fp8",
                       "--output_dir", str(tmp_path / "o"), "--use_cpu", "True", "--report_to", "none"])


def test_retrofit_saves_the_merged_student_in_the_teachers_dtype(tmp_path):
    from kvpop_hf.cli import retrofit
    from test_streaming_plus import _teacher

    teacher = _teacher(tmp_path)
    AutoModelForCausalLM.from_pretrained(teacher).to(torch.bfloat16).save_pretrained(teacher)
    common = ["--model", str(teacher), "--dataset", "testbed:reasoning", "--seq_len", "256", "--sinks", "4",
              "--window", "16", "--topk", "8", "--scorer", "mlp", "--lora_rank", "4", "--merge_lora", "True",
              "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy", "no",
              "--use_cpu", "True", "--disable_tqdm", "True"]
    assert retrofit.main(common + ["--output_dir", str(tmp_path / "bf16")]) == 0  # the exit status of the command
    assert _file_dtypes(tmp_path / "bf16") == {"torch.bfloat16"}
    retrofit.main(common + ["--output_dir", str(tmp_path / "f32"), "--merged_dtype", "float32"])
    assert _file_dtypes(tmp_path / "f32") == {"torch.float32"}
