"""kvpop_lab.testbed.weight_delta: a student stored as the tensors that differ from its base loads bit for bit as
the full checkpoint did, through testbed.models.load_model; a changed, missing or mismatched base is refused."""

import json

import pytest
import torch

from kvpop_lab.testbed.models import load_model
from kvpop_lab.testbed.weight_delta import DELTA_CONFIG, is_weight_delta, save_weight_delta
from helpers import distinct_ids, tiny_model

pytestmark = pytest.mark.tier("scripts")


@pytest.fixture()
def pair(tmp_path):
    base = tiny_model(seed=0)
    base.save_pretrained(tmp_path / "base")
    student = tiny_model(seed=0)
    with torch.no_grad():  # what a merged LoRA does: the attention projections move, the rest stays
        for layer in student.model.layers:
            layer.self_attn.q_proj.weight.add_(0.01 * torch.randn_like(layer.self_attn.q_proj.weight))
            layer.self_attn.v_proj.weight.add_(0.01 * torch.randn_like(layer.self_attn.v_proj.weight))
    student.save_pretrained(tmp_path / "students" / "s")
    return tmp_path / "base", tmp_path / "students" / "s", student


def test_round_trip_is_bit_exact(pair):
    base_dir, student_dir, student = pair
    out = save_weight_delta(student_dir, base_dir)
    assert out["kept"] == 2 * len(student.model.layers) and out["total"] > out["kept"]
    assert is_weight_delta(student_dir) and not (student_dir / "model.safetensors").exists()
    assert json.loads((student_dir / DELTA_CONFIG).read_text())["base_model"] == "../../base"
    loaded = load_model(str(student_dir), torch.float32, torch.device("cpu"))
    ref = student.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, ref[name].float()), name
    ids = distinct_ids(1, 12)
    torch.testing.assert_close(loaded(ids).logits, student.float().eval()(ids).logits, rtol=0, atol=0)


def test_changed_or_missing_base_is_refused(pair):
    base_dir, student_dir, _ = pair
    save_weight_delta(student_dir, base_dir)
    other = tiny_model(seed=1)
    other.save_pretrained(base_dir)
    with pytest.raises(ValueError, match="changed since the delta was written"):
        load_model(str(student_dir), torch.float32, torch.device("cpu"))
    (base_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="restore that base model"):
        load_model(str(student_dir), torch.float32, torch.device("cpu"))


def test_another_architecture_is_refused(tmp_path, pair):
    base_dir, _, _ = pair
    deeper = tiny_model(seed=0, layers=3)
    deeper.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match="same architecture"):
        save_weight_delta(tmp_path / "deeper", base_dir)
    with pytest.raises(FileNotFoundError, match="no "):
        save_weight_delta(tmp_path / "nowhere", base_dir)
