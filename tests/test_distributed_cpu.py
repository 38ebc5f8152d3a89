"""Two CPU processes (gloo) give the same scorer update as one process with the same global batch,
with DDP, and with the Trainer's FSDP2 flags (decoder layers as wrap units, the scorer in the root unit).
Note: accelerate enables FSDP only on accelerators, so on CPU the "fsdp2" case runs as DDP -- it checks
that the FSDP flags are accepted end to end, not sharding. Real FSDP2 (``fully_shard``, bf16 mixed
precision) over a LoRA student is in ``tests/test_fsdp2_lora_cpu.py``.

Uses ``torchrun`` (what ``accelerate launch --multi_gpu`` runs under the hood); the Trainer drives
DDP through accelerate in both cases.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import tiny_model

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]


def _retrofit_cmd(model_dir, out, per_device_batch):
    return ["training/retrofit.py", "--model", str(model_dir), "--dataset", "testbed:reasoning,vt",
            "--seq_len", "192", "--num_examples", "4", "--sinks", "2", "--window", "8", "--topk", "16",
            "--scorer", "mlstm", "--scorer_kwargs", '{"state_dim": 8}', "--output_dir", str(out),
            "--max_steps", "2", "--per_device_train_batch_size", str(per_device_batch), "--optim", "sgd",
            "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0",
            "--train_backbone", "False", "--logging_steps", "1", "--report_to", "none", "--use_cpu",
            "--save_strategy", "no", "--seed", "0", "--disable_tqdm", "True"]


FSDP2 = ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
         '{"transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"], "version": 2}']


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_gloo_processes_match_one_process(tmp_path, mode):
    from kvpop_lab.testbed import build_tokenizer

    tok = build_tokenizer()
    model = tiny_model("qwen3", attn="sdpa", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    single = subprocess.run([sys.executable] + _retrofit_cmd(tmp_path / "model", tmp_path / "one", 2),
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", "29517" if mode == "ddp" else "29519"] + _retrofit_cmd(tmp_path / "model", tmp_path / "two", 1)
                           + ["--ddp_backend", "gloo"] + (FSDP2 if mode == "fsdp2" else []), cwd=ROOT, env=env, capture_output=True, text=True)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a = load_file(tmp_path / "one" / "kvpop_scorer.safetensors")
    b = load_file(tmp_path / "two" / "kvpop_scorer.safetensors")
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)


def test_cli_closes_the_process_group_after_success_and_failure():
    """The training CLIs end the process group themselves (an exit with gloo threads alive aborts a rank)."""
    import torch.distributed as dist

    from kvpop_hf.cli.common import run_cli

    def train(argv):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
        if argv == ["fail"]:
            raise RuntimeError("a rank failed")

    run_cli(train, [])
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="a rank failed"):
        run_cli(train, ["fail"])
    assert not dist.is_initialized()
