"""DMSTrainer: distil a model with DMS eviction gates from its dense self (Łańcucki et al., 2025; the learned
baseline of KVpop, arXiv:2607.05061).

Loss per batch: ``KL(teacher || student) + compression_weight * max(0, rate(step) - mean alpha)`` (or
``|rate(step) - mean alpha|`` with ``penalty="two_sided"``); the student runs the relaxed delayed-eviction
attention (``"dms_train"``), the teacher is the same model with its LoRA adapters disabled (or a frozen copy); the
KL is taken from both final hidden states through the LM head chunk by chunk. The teacher, the step order, the
saves and resuming are :class:`~kvpop_hf.trainer.distillation.DistillationTrainer`'s, shared with KVpopTrainer.
``rate(step)`` ramps linearly from 0 to ``target_eviction`` over the first ``ramp_fraction`` of the steps
(:class:`~kvpop_hf.baselines.dms.compression.CompressionSchedule`), or over the first ``ramp_seconds`` of
training when that is set (for runs bounded by time, not steps). The gate reads detached value states, so only
the distillation trains the backbone.

Checkpoints hold the model (``config.json`` + ``model.safetensors``) and the gate (``dms_config.json`` +
``dms_gate.safetensors``): ``AutoModelForCausalLM.from_pretrained(d)`` and ``DMSCache.from_pretrained(d, cfg)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from ...config import model_shape, require_full_attention
from ...trainer.distillation import DistillationTrainer, StudentPass
from ...trainer.hidden_states import unwrap_model
from . import config as dms_files
from .compression import CompressionSchedule, compression_loss, mean_eviction
from .config import DMSConfig
from .gate import DMSGate
from .train_attention import TRAIN_ATTN_NAME, dms_forward

GATE_ATTR = "dms_gate"


@dataclass
class DMSTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the DMS window, target and loss settings."""

    sinks: int = field(default=4, metadata={"help": "First tokens never evicted."})
    window: int = field(default=32, metadata={"help": "Delayed-eviction window w."})
    target_eviction: float = field(default=0.0, metadata={
        "help": "Final eviction rate over tokens t >= sinks (train_dms.py derives it from --compression)."})
    ramp_fraction: float = field(default=0.5, metadata={"help": "Fraction of the steps over which the rate ramps up."})
    ramp_seconds: float | None = field(default=None, metadata={
        "help": "Ramp the rate up over this many seconds from the first step instead (runs bounded by time)."})
    compression_weight: float = field(default=10.0, metadata={"help": "Weight of the compression penalty."})
    penalty: str = field(default="one_sided", metadata={
        "help": "one_sided: max(0, rate - mean alpha) (DMS) | two_sided: |rate - mean alpha| (matched memory)."})
    gate_temperature: float = field(default=0.3, metadata={
        "help": "Gumbel-sigmoid temperature of the gates in training."})
    gate_learning_rate: float = field(default=1e-1, metadata={"help": "Learning rate of the gate."})
    gate_init_bias: float = field(default=-2.0, metadata={"help": "Initial gate bias (sigmoid: starting eviction rate)."})
    distill_temperature: float = field(default=1.0)

    def __post_init__(self):
        super().__post_init__()
        self.remove_unused_columns = False
        DMSConfig(sinks=self.sinks, window=self.window, gate_temperature=self.gate_temperature)  # validates
        if not 0.0 <= self.target_eviction < 1.0:
            raise ValueError(f"target_eviction must be in [0, 1), got {self.target_eviction}.")
        if not 0.0 <= self.ramp_fraction <= 1.0:
            raise ValueError(f"ramp_fraction must be in [0, 1], got {self.ramp_fraction}.")
        if self.ramp_seconds is not None and not self.ramp_seconds >= 0:
            raise ValueError(f"ramp_seconds must be >= 0, got {self.ramp_seconds}.")
        if self.penalty not in ("one_sided", "two_sided"):
            raise ValueError(f"penalty must be 'one_sided' or 'two_sided', got {self.penalty!r}.")
        if self.compression_weight < 0 or self.gate_learning_rate <= 0:
            raise ValueError("compression_weight must be >= 0 and gate_learning_rate > 0.")


class DMSTrainer(DistillationTrainer):
    """A `transformers.Trainer` that trains DMS gates and distils the backbone (a PEFT LoRA model is supported);
    the shared sequence (teacher, step order, saves, resuming) is `DistillationTrainer`'s, the gate its part."""

    train_attn_implementation = TRAIN_ATTN_NAME

    def __init__(self, model=None, args: DMSTrainingArguments = None, teacher_model=None, gate=None, **kwargs):
        if not isinstance(args, DMSTrainingArguments):
            raise ValueError("DMSTrainer needs `args=DMSTrainingArguments(...)`.")
        config = unwrap_model(model).config
        require_full_attention(config, "DMSTrainer")
        layers, heads, head_dim = model_shape(config)
        gate = gate if gate is not None else DMSGate(layers, heads, head_dim, init_bias=args.gate_init_bias)
        self.dms_config = DMSConfig(sinks=args.sinks, window=args.window, target_eviction=args.target_eviction,
                                    gate_temperature=args.gate_temperature, num_layers=layers, num_kv_heads=heads,
                                    head_dim=head_dim,
                                    base_model=getattr(config, "_name_or_path", None) or None)
        super().__init__(model, args, {GATE_ATTR: gate.requires_grad_(True)}, teacher_model, **kwargs)
        ramp = math.ceil(args.ramp_fraction * max(1, args.max_steps))
        self.schedule = CompressionSchedule(args.target_eviction, ramp)
        self._ramp_start: float | None = None

    @property
    def gate(self) -> DMSGate:
        return self.part(GATE_ATTR)

    def parts_learning_rate(self) -> float:
        return self.args.gate_learning_rate

    def target_rate(self) -> float:
        """The compression target now: by step (``ramp_fraction``), or by the time since the first step
        (``ramp_seconds``)."""
        seconds = self.args.ramp_seconds
        if seconds is None:
            return self.schedule.rate(self.state.global_step)
        now = time.monotonic()
        self._ramp_start = self._ramp_start if self._ramp_start is not None else now
        frac = 1.0 if seconds == 0 else min(1.0, (now - self._ramp_start) / seconds)
        return self.args.target_eviction * frac

    def student_pass(self, model, inputs) -> StudentPass:
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("DMSTrainer needs unpadded batches: use equal-length sequences.")
        args = self.args
        outputs, record, hidden = dms_forward(model, self.gate, args.sinks, args.window, args.gate_temperature,
                                              return_hidden=True,
                                              input_ids=inputs["input_ids"])
        return StudentPass(outputs, hidden, record, inputs.get("labels"))

    def training_loss(self, model, student: StudentPass, teacher_hidden):
        d_loss = self.distillation_loss(model, student, teacher_hidden)
        rate = self.target_rate()
        alpha = mean_eviction(list(student.record.alpha.values()), self.args.sinks)
        c_loss = compression_loss(alpha, rate, two_sided=self.args.penalty == "two_sided")
        loss = d_loss + self.args.compression_weight * c_loss
        logs = {"distill_loss": d_loss, "compression_loss": c_loss, "target_eviction": rate, "eviction_soft": alpha,
                "eviction_hard": torch.stack(list(student.record.hard_rate.values())).mean()}
        return loss, logs

    # -- checkpoints: the model files + dms_config.json and dms_gate.safetensors ------------------------
    def save_parts(self, output_dir, parts):
        dms_files.save(output_dir, self.dms_config, parts[GATE_ATTR])

    def load_parts(self, checkpoint_dir):
        _, state = dms_files.load(checkpoint_dir)
        self.gate.load_state_dict(state)
