"""DistillationTrainer (the sequence KVpopTrainer and DMSTrainer share) through a minimal subclass: a gate and a
scale as its parts, a loss of its own."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from helpers import distinct_ids, tiny_model
from kvpop_hf.trainer import distillation
from kvpop_hf.trainer.distillation import DistillationTrainer, StudentPass
from kvpop_hf.trainer.hidden_states import final_hidden_states, unwrap_model

pytestmark = pytest.mark.tier("unit")

PARTS = ("probe_gate", "probe_scale")


@dataclass
class ProbeArguments(TrainingArguments):
    distill_temperature: float = 1.0


class Probe(DistillationTrainer):
    """Student pass: the model's final hidden states times the ``probe_scale`` part; loss: the ``probe_gate``
    part's squared output, plus the distillation when there is a teacher. ``events`` records the step's order."""

    train_attn_implementation = "eager"

    def __init__(self, model, args, parts_lr=None, **kwargs):
        self.events, self.saved, self.loaded, self.parts_lr = [], [], [], parts_lr
        hidden = model.config.hidden_size
        parts = {"probe_gate": nn.Linear(hidden, 1), "probe_scale": nn.Parameter(torch.ones(()))}
        super().__init__(model, args, parts, **kwargs)
        if self.teacher_model is not None:
            self.teacher_model.register_forward_hook(
                lambda *_: self.events.append(("teacher", torch.is_grad_enabled())))

    def student_pass(self, model, inputs):
        self.events.append(("student", unwrap_model(model).config._attn_implementation))
        outputs, hidden = final_hidden_states(model, input_ids=inputs["input_ids"])
        return StudentPass(outputs, hidden * self.part("probe_scale"), labels=inputs.get("labels"))

    def training_loss(self, model, student, teacher_hidden):
        teacher_grad = teacher_hidden is not None and teacher_hidden.requires_grad
        self.events.append(("loss", torch.is_grad_enabled(), teacher_grad))
        loss = self.part("probe_gate")(student.hidden).pow(2).mean()
        logs = {"constant": 2.0}
        if teacher_hidden is not None:
            logs["distill_loss"] = self.distillation_loss(model, student, teacher_hidden)
            loss = loss + logs["distill_loss"]
        return loss, logs

    def save_parts(self, output_dir, parts):
        self.saved.append(dict(parts))
        torch.save({"scale": parts["probe_scale"].detach()}, f"{output_dir}/probe.pt")

    def load_parts(self, checkpoint_dir):
        self.loaded.append(str(checkpoint_dir))
        with torch.no_grad():
            self.part("probe_scale").copy_(torch.load(f"{checkpoint_dir}/probe.pt")["scale"])

    def parts_learning_rate(self):
        return self.parts_lr


def probe(tmp_path, parts_lr=None, **kw):
    args = ProbeArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                          learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                          disable_tqdm=True, seed=0, remove_unused_columns=False)
    rows = [{"input_ids": r, "labels": r.clone()} for r in distinct_ids(4, 24)]
    return Probe(tiny_model("qwen3", attn="sdpa"), args, parts_lr=parts_lr, train_dataset=rows, **kw)


def parts_attached(trainer):
    base = unwrap_model(trainer.model)
    return (isinstance(base._modules.get("probe_gate"), nn.Linear)
            and isinstance(base._parameters.get("probe_scale"), nn.Parameter))


def test_step_runs_the_student_then_the_teacher_without_gradient(tmp_path):
    trainer = probe(tmp_path)
    teacher = trainer.teacher_model
    assert teacher is not None and not trainer.is_peft and not teacher.training
    assert not any(hasattr(teacher, name) for name in PARTS)  # a copy of the backbone alone
    assert not any(p.requires_grad for p in teacher.parameters())
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    trainer.train()
    assert trainer.events == [("student", "eager"), ("teacher", False), ("loss", True, False)] * 2
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, teacher_before[k]) for k, v in teacher.state_dict().items())
    assert float(trainer.part("probe_scale")) != 1.0  # the part trained through the student's hidden states
    logs = [e for e in trainer.state.log_history if "distill_loss" in e]
    assert len(logs) == 2 and all(e["constant"] == 2.0 for e in logs)


def test_no_teacher_without_distillation_or_with_a_frozen_backbone(tmp_path):
    trainer = probe(tmp_path, distil=False)
    assert trainer.teacher_model is None and not trainer.distils
    trainer.train()
    assert ("loss", True, False) in trainer.events and not [e for e in trainer.events if e[0] == "teacher"]
    frozen = probe(tmp_path, train_backbone=False)
    assert frozen.teacher_model is None and not frozen.distils
    trainable = {n for n, p in frozen.model.named_parameters() if p.requires_grad}
    assert trainable == {"probe_gate.weight", "probe_gate.bias", "probe_scale"}


def test_parts_learning_rate_makes_a_second_group(tmp_path):
    trainer = probe(tmp_path, parts_lr=0.5)
    groups = trainer.create_optimizer().param_groups
    assert len(groups) == 2 and groups[0]["lr"] == 0.5 and groups[0]["weight_decay"] == 0.0
    own = {id(p) for n, p in trainer.model.named_parameters() if n.startswith(PARTS)}
    assert {id(p) for p in groups[0]["params"]} == own and len(own) == 3
    assert groups[1]["lr"] == 1e-2 and not own & {id(p) for p in groups[1]["params"]}
    default = probe(tmp_path).create_optimizer().param_groups
    assert all(g["lr"] == 1e-2 for g in default)


def test_save_writes_the_model_without_its_parts_under_sdpa_and_restores_both(tmp_path, monkeypatch):
    trainer = probe(tmp_path)
    seen = []
    original = Trainer._save

    def spy(self, output_dir=None, state_dict=None):
        seen.append((unwrap_model(self.model).config._attn_implementation, parts_attached(self), sorted(state_dict)))
        return original(self, output_dir, state_dict=state_dict)

    monkeypatch.setattr(Trainer, "_save", spy)
    trainer.save_model(str(tmp_path / "saved"))
    attn, attached, keys = seen[0]
    assert attn == "sdpa" and not attached and not [k for k in keys if k.startswith(PARTS)]
    assert unwrap_model(trainer.model).config._attn_implementation == "eager" and parts_attached(trainer)
    assert trainer.saved[0]["probe_gate"] is trainer.part("probe_gate")
    assert (tmp_path / "saved" / "model.safetensors").is_file() and (tmp_path / "saved" / "probe.pt").is_file()


def test_attention_and_parts_restored_after_a_failed_save(tmp_path, monkeypatch):
    trainer = probe(tmp_path)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Trainer, "_save", fail)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_model(str(tmp_path / "saved"))
    assert unwrap_model(trainer.model).config._attn_implementation == "eager" and parts_attached(trainer)
    monkeypatch.setattr(distillation, "save_weights_as", fail)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_merged_model(str(tmp_path / "merged"))
    assert unwrap_model(trainer.model).config._attn_implementation == "eager" and parts_attached(trainer)
    assert trainer.saved == []  # the parts' files are written only after the model files


def test_frozen_backbone_saves_and_resumes_the_parts_alone(tmp_path):
    trainer = probe(tmp_path, train_backbone=False)
    with torch.no_grad():
        trainer.part("probe_scale").fill_(3.0)
    trainer.save_model(str(tmp_path / "saved"))
    assert sorted(p.name for p in (tmp_path / "saved").iterdir() if p.name != "training_args.bin") == ["probe.pt"]
    with torch.no_grad():
        trainer.part("probe_scale").fill_(1.0)
    trainer._load_from_checkpoint(str(tmp_path / "saved"))  # no model files: the backbone is left as loaded
    assert trainer.loaded == [str(tmp_path / "saved")] and float(trainer.part("probe_scale")) == 3.0


def test_logs_are_averaged_between_log_lines_skipping_nan(tmp_path):
    trainer = probe(tmp_path)
    trainer.record_logs({"a": torch.tensor(1.0), "b": float("nan"), "c": 0.25})
    trainer.record_logs({"a": torch.tensor(3.0), "b": float("nan"), "c": torch.tensor(float("nan"))})
    trainer.log({"loss": 0.0})
    last = trainer.state.log_history[-1]
    assert last["a"] == 2.0 and last["c"] == 0.25 and "b" not in last
    trainer.log({"loss": 0.0})
    assert "a" not in trainer.state.log_history[-1]  # emptied by the previous line


def test_a_subclass_must_name_its_training_attention(tmp_path):
    class Nameless(Probe):
        train_attn_implementation = ""

    with pytest.raises(TypeError, match="train_attn_implementation"):
        Nameless(tiny_model("qwen3", attn="sdpa"), ProbeArguments(output_dir=str(tmp_path), report_to=[]))


def test_student_pass_masks_the_supervised_positions():
    labels = torch.tensor([[-100, 5, 6, -100]])
    student = StudentPass(outputs=None, hidden=torch.zeros(1, 4, 2), labels=labels)
    assert student.token_mask.tolist() == [[True, True, False, False]]
    assert StudentPass(outputs=None, hidden=torch.zeros(1, 4, 2)).token_mask is None
