"""training/retrofit.py on the CPU: --bf16 refused with the fix named, and a scorer-only run saves the scorer,
not a copy of the unchanged backbone."""

import pytest
import torch
from safetensors.torch import load_file

from kvpop_hf import KVpopCache
from kvpop_hf.cli import common, retrofit
from kvpop_hf.hub import CONFIG_NAME, WEIGHTS_NAME

pytestmark = pytest.mark.tier("scripts")


@pytest.mark.parametrize("flag", [["--bf16"], ["--bf16", "True"], ["--bf16=true"]])
def test_bf16_without_a_gpu_fails_before_loading_anything(tmp_path, monkeypatch, flag):
    monkeypatch.setattr(common, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(common, "is_torch_xla_available", lambda: False)
    with pytest.raises(ValueError, match="drop --bf16 on CPU"):
        retrofit.main(["--model", str(tmp_path / "never_loaded"), "--output_dir", str(tmp_path / "o"),
                       "--report_to", "none"] + flag)
    retrofit.check_bf16_device(["--bf16", "--use_cpu", "True"])  # CPU bf16 autocast, asked for explicitly
    retrofit.check_bf16_device(["--bf16", "False"])
    monkeypatch.setattr(common, "is_torch_bf16_gpu_available", lambda: True)
    retrofit.check_bf16_device(["--bf16"])


def _argv(teacher, out, *extra):
    return ["--model", str(teacher), "--dataset", "testbed:reasoning", "--seq_len", "192", "--num_examples", "4",
            "--sinks", "2", "--window", "8", "--topk", "16", "--scorer", "mlp", "--train_backbone", "False",
            "--output_dir", str(out), "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
            "--logging_steps", "1", "--report_to", "none", "--use_cpu", "True", "--disable_tqdm", "True",
            "--seed", "0", *extra]


def test_scorer_only_retrofit_saves_the_scorer_without_the_backbone(tmp_path):
    from test_streaming_plus import _teacher

    teacher = _teacher(tmp_path)
    out = tmp_path / "o"
    trainer = retrofit.train(_argv(teacher, out, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"))
    files = {p.name for p in out.iterdir()}
    assert {CONFIG_NAME, WEIGHTS_NAME, "README.md", "tokenizer_config.json"} <= files
    assert not {"model.safetensors", "config.json", "adapter_model.safetensors", "training_args.bin"} & files
    assert not [p for p in out.rglob("*.safetensors") if p.name != WEIGHTS_NAME]  # checkpoint-N folders too
    assert set(load_file(out / WEIGHTS_NAME)) == set(trainer.scorer.state_dict())
    cache = KVpopCache.from_pretrained(out)
    for k, v in trainer.scorer.state_dict().items():
        assert torch.equal(cache.scorer.state_dict()[k], v.float())
    assert f'from_pretrained("{teacher}"' in (out / "README.md").read_text()  # the card loads the base model
    # resuming a scorer-only checkpoint reads the scorer alone (the backbone is the --model, unchanged)
    t2 = retrofit.train(_argv(teacher, tmp_path / "o2", "--max_steps", "3", "--save_strategy", "no",
                             "--resume_from_checkpoint", str(out / "checkpoint-2")))
    assert t2.state.global_step == 3
