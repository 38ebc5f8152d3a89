"""DMSTrainer: distil a model with DMS eviction gates from its dense self (Łańcucki et al., 2025; the learned
baseline of KVpop, arXiv:2607.05061).

Loss per batch: ``KL(teacher || student) + compression_weight * max(0, rate(step) - mean alpha)`` (or
``|rate(step) - mean alpha|`` with ``penalty="two_sided"``); the student
runs the relaxed delayed-eviction attention (``"dms_train"``), the teacher is the same model with its LoRA
adapters disabled (or a frozen copy); the KL is taken from both final hidden states through the LM head chunk by
chunk (``training/teacher_distillation.py``), as in KVpopTrainer. ``rate(step)`` ramps linearly from 0 to ``target_eviction`` over the first
``ramp_fraction`` of the steps (:class:`~kvpop_hf.baselines.dms.compression.CompressionSchedule`), or over the first
``ramp_seconds`` of training when that is set (for runs bounded by time, not steps). The gate reads detached
value states, so only the distillation trains the backbone.

Checkpoints hold the model (``config.json`` + ``model.safetensors``) and the gate (``dms_config.json`` +
``dms_gate.safetensors``): ``AutoModelForCausalLM.from_pretrained(d)`` and ``DMSCache.from_pretrained(d, cfg)``.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from ...config import model_shape, require_full_attention
from ...trainer.hidden_states import lm_head_of, unwrap_model
from ...trainer.teacher_distillation import distillation_from_hidden, supervised_positions, teacher_hidden_states
from ...trainer.merged_save import save_weights_as
from ...trainer.trainer import two_group_optimizer
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
    tau: float = field(default=0.3, metadata={"help": "Gumbel-sigmoid temperature."})
    gate_learning_rate: float = field(default=1e-1, metadata={"help": "Learning rate of the gate."})
    gate_init_bias: float = field(default=-2.0, metadata={"help": "Initial gate bias (sigmoid: starting eviction rate)."})
    distill_temperature: float = field(default=1.0)

    def __post_init__(self):
        super().__post_init__()
        self.remove_unused_columns = False
        DMSConfig(sinks=self.sinks, window=self.window, tau=self.tau)  # validates
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


class DMSTrainer(Trainer):
    """A `transformers.Trainer` that trains DMS gates and distils the backbone (a PEFT LoRA model is supported)."""

    loss_is_scaled_for_ga = False

    def __init__(self, model=None, args: DMSTrainingArguments = None, teacher_model=None, gate=None, **kwargs):
        if not isinstance(args, DMSTrainingArguments):
            raise ValueError("DMSTrainer needs `args=DMSTrainingArguments(...)`.")
        base = unwrap_model(model)
        require_full_attention(base.config, "DMSTrainer")
        layers, heads, head_dim = model_shape(base.config)
        gate = gate if gate is not None else DMSGate(layers, heads, head_dim, init_bias=args.gate_init_bias)
        base.add_module(GATE_ATTR, gate.requires_grad_(True))
        self.dms_config = DMSConfig(sinks=args.sinks, window=args.window, target_eviction=args.target_eviction,
                                    tau=args.tau, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                                    base_model=getattr(base.config, "_name_or_path", None) or None)
        self.is_peft = hasattr(model, "disable_adapter")
        if teacher_model is None and not self.is_peft:
            teacher_model = copy.deepcopy(base)
            delattr(teacher_model, GATE_ATTR)
        if teacher_model is not None:
            teacher_model.requires_grad_(False).eval()
        self.teacher_model = teacher_model
        base.set_attn_implementation(TRAIN_ATTN_NAME)
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False
        ramp = math.ceil(args.ramp_fraction * max(1, args.max_steps))
        self.schedule = CompressionSchedule(args.target_eviction, ramp)
        self._ramp_start: float | None = None
        self._dms_logs: dict[str, list[float]] = {}

    @property
    def gate(self) -> DMSGate:
        return getattr(unwrap_model(self.model), GATE_ATTR)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = two_group_optimizer(self, (GATE_ATTR,), self.args.gate_learning_rate)
        return self.optimizer

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

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("DMSTrainer needs unpadded batches: use equal-length sequences.")
        args = self.args
        outputs, record, hidden = dms_forward(model, self.gate, args.sinks, args.window, args.tau, return_hidden=True,
                                              input_ids=ids)
        teacher_hidden = teacher_hidden_states(model, self.teacher_model, ids)
        token_mask = supervised_positions(inputs.get("labels"))
        d_loss = distillation_from_hidden(model, self.teacher_model, hidden, teacher_hidden, args.distill_temperature,
                                          token_mask)
        rate = self.target_rate()
        alpha = mean_eviction(list(record.alpha.values()), args.sinks)
        c_loss = compression_loss(alpha, rate, two_sided=self.args.penalty == "two_sided")
        loss = d_loss + args.compression_weight * c_loss
        logs = {"distill_loss": d_loss.item(), "compression_loss": c_loss.item(), "target_eviction": rate,
                "eviction_soft": alpha.item(),
                "eviction_hard": torch.stack(list(record.hard_rate.values())).mean().item()}
        for key, value in logs.items():
            self._dms_logs.setdefault(key, []).append(value)
        if return_outputs:
            outputs.logits = lm_head_of(model)(hidden)  # evaluation asks for them (small batches)
            return loss, outputs
        return loss

    def log(self, logs, start_time=None):
        for key, values in self._dms_logs.items():
            logs[key] = sum(values) / len(values)
        self._dms_logs = {}
        return super().log(logs) if start_time is None else super().log(logs, start_time)

    # -- checkpoints ------------------------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.model.state_dict() if state_dict is None else state_dict
        state_dict = {k: v for k, v in state_dict.items() if GATE_ATTR not in k}
        base = unwrap_model(self.model)
        gate = base._modules.pop(GATE_ATTR)
        attn, base.config._attn_implementation = base.config._attn_implementation, "sdpa"
        try:
            super()._save(output_dir, state_dict=state_dict)
        finally:
            base.config._attn_implementation = attn
            base.add_module(GATE_ATTR, gate)
        dms_files.save(output_dir, self.dms_config, gate)

    def save_merged_model(self, output_dir=None, dtype: torch.dtype | None = None):
        """A plain model directory (LoRA merged into the weights, cast to ``dtype`` if given) with the tokenizer
        and the DMS gate files."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.is_world_process_zero():
            return
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
            self.model = model
        base = unwrap_model(model)
        gate = base._modules.pop(GATE_ATTR)
        attn, base.config._attn_implementation = base.config._attn_implementation, "sdpa"
        try:
            save_weights_as(base, output_dir, dtype)
        finally:
            base.config._attn_implementation = attn
            base.add_module(GATE_ATTR, gate)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            (Path(output_dir) / name).unlink(missing_ok=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        dms_files.save(output_dir, self.dms_config, gate)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        _, state = dms_files.load(resume_from_checkpoint)
        self.gate.load_state_dict(state)
