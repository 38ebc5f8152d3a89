"""DistillationTrainer: the training sequence that KVpopTrainer (and StreamingLLM+, its fixed-scorer use) and
DMSTrainer share.

A subclass attaches its trainable *parts* (a scorer, a decay, a gate: modules or parameters set on the
transformers model under fixed attribute names, so optimisers, DDP/FSDP and checkpoints see them) and names the
attention implementation its student runs. The base class then owns:

* the teacher: ``teacher_model`` if given, else the same model with its LoRA adapters disabled (a PEFT student),
  else a frozen deep copy without the parts;
* the step: the student pass first (``student_pass``), the teacher's final hidden states second, without
  gradient, then the subclass's ``training_loss``; its logs are averaged over the steps between two log lines;
* the optimizer: the parts at their own learning rate (``parts_learning_rate``), everything else at the trainer's;
* the saves: the model files written with the parts taken off the model and ``"sdpa"`` in the saved config (so
  ``from_pretrained`` loads it anywhere), both restored afterwards even when the save fails, then the parts'
  files written by the subclass (``save_parts``); a LoRA student merged into its weights by
  ``save_merged_model``; resuming reads the parts back (``load_parts``).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function
from transformers import Trainer

from .hidden_states import lm_head_of, unwrap_model
from .merged_save import save_weights_as
from .teacher_distillation import distillation_from_hidden, supervised_positions, teacher_hidden_states


@dataclass
class StudentPass:
    """What the student pass hands to the loss: the model output (``logits`` unset), the final hidden states
    ``hidden [B, S, H]``, the attention layers' ``record`` (the subclass's own type), the batch's ``labels [B, S]``
    (or None) and ``token_mask [B, S]`` bool, the positions the distillation averages over (default: those whose
    next token has a label; None without labels)."""

    outputs: Any
    hidden: torch.Tensor
    record: Any = None
    labels: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None

    def __post_init__(self):
        if self.token_mask is None:
            self.token_mask = supervised_positions(self.labels)


class DistillationTrainer(Trainer):
    """A `transformers.Trainer` that trains ``parts`` attached to the model and distils the student from its dense
    teacher. Subclasses set ``train_attn_implementation`` and implement ``student_pass``, ``training_loss``,
    ``save_parts`` and ``load_parts`` (and ``parts_learning_rate`` for a separate learning rate).

    Args:
        model: the student (a PEFT LoRA model is supported).
        args: the subclass's `TrainingArguments` (``distill_temperature`` is read).
        parts: ``{attribute name: nn.Module | nn.Parameter}`` set on the transformers model, their
            ``requires_grad`` as the subclass wants it.
        teacher_model: the frozen dense teacher (default: see the module docstring).
        distil: whether the loss distils from the teacher (False: no teacher is built and no teacher pass runs).
        train_backbone: False freezes every parameter but the parts; checkpoints then hold the parts only.
    """

    loss_is_scaled_for_ga = False  # the loss is the mean of one micro-batch
    train_attn_implementation: str = ""  # the attention implementation the student trains under

    def __init__(self, model, args, parts: dict[str, nn.Module | nn.Parameter], teacher_model=None, *,
                 distil: bool = True, train_backbone: bool = True, **kwargs):
        if not self.train_attn_implementation:
            raise TypeError(f"{type(self).__name__} must set `train_attn_implementation` (the attention name its "
                            "student trains under).")
        base = unwrap_model(model)
        for name, part in parts.items():
            if isinstance(part, nn.Parameter):
                base.register_parameter(name, part)
            else:
                base.add_module(name, part)
        self.part_names = tuple(parts)
        self.is_peft = hasattr(model, "disable_adapter")
        self.trains_backbone = train_backbone
        self.distils = distil and train_backbone
        if not train_backbone:
            for name, p in base.named_parameters():
                if not name.startswith(self.part_names):
                    p.requires_grad_(False)
            teacher_model = None
        elif teacher_model is None and not self.is_peft and distil:
            teacher_model = _copy_without(base, self.part_names)
        if teacher_model is not None:
            teacher_model.requires_grad_(False).eval()
        self.teacher_model = teacher_model
        base.set_attn_implementation(self.train_attn_implementation)
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False
        self._kvpop_logs: dict[str, list[float]] = {}

    # -- what a subclass defines ----------------------------------------------------------------------
    def student_pass(self, model, inputs) -> StudentPass:
        """The student's forward on one batch (checks of the batch first)."""
        raise NotImplementedError

    def training_loss(self, model, student: StudentPass, teacher_hidden: torch.Tensor | None):
        """``(loss, logs)``: the 0-d loss and ``{name: 0-d tensor or float}`` to log. ``teacher_hidden [B, S, H]``
        is None when the trainer does not distil."""
        raise NotImplementedError

    def save_parts(self, output_dir, parts: dict[str, nn.Module | nn.Parameter]) -> None:
        """Write the parts' own files into ``output_dir``."""
        raise NotImplementedError

    def load_parts(self, checkpoint_dir) -> None:
        """Read the parts back from a checkpoint directory (resuming)."""
        raise NotImplementedError

    def parts_learning_rate(self) -> float | None:
        """The parts' learning rate; None: one group at the trainer's learning rate."""
        return None

    # -- the step ----------------------------------------------------------------------------------
    def part(self, name: str):
        """The attached part ``name`` of the trainer's model."""
        return getattr(unwrap_model(self.model), name)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Student first, teacher second: a LoRA teacher pass disables the adapters, and PEFT turns their
        # requires_grad off meanwhile. Under FSDP2 the first forward of the run fixes each shard group's
        # gradient dtype from the parameters that require grad at that moment; if that first forward were
        # the teacher's, groups would get none and the bf16 gradients would later fail to land on the fp32
        # shards (pytorch/pytorch#186998).
        student = self.student_pass(model, inputs)
        teacher_hidden = None
        if self.distils:
            with record_function("kvpop.teacher_forward"):
                teacher_hidden = teacher_hidden_states(model, self.teacher_model, inputs["input_ids"])
        loss, logs = self.training_loss(model, student, teacher_hidden)
        self.record_logs(logs)
        if return_outputs:
            student.outputs.logits = lm_head_of(model)(student.hidden)  # evaluation asks for them (small batches)
            return loss, student.outputs
        return loss

    def distillation_loss(self, model, student: StudentPass, teacher_hidden: torch.Tensor) -> torch.Tensor:
        """``T^2 KL(teacher || student)`` over ``student.token_mask``, through the LM heads chunk by chunk."""
        with record_function("kvpop.distillation"):
            return distillation_from_hidden(model, self.teacher_model, student.hidden, teacher_hidden,
                                            self.args.distill_temperature, student.token_mask)

    def record_logs(self, logs: dict[str, torch.Tensor | float]) -> None:
        """Keep this step's values for the next log line; the tensors are read back in one transfer."""
        tensors = [v for v in logs.values() if torch.is_tensor(v)]
        if tensors:
            device = tensors[0].device
            read = iter(torch.stack([v.detach().float().to(device) for v in tensors]).tolist())
        for key, value in logs.items():
            self._kvpop_logs.setdefault(key, []).append(next(read) if torch.is_tensor(value) else float(value))

    def log(self, logs, start_time=None):
        """Adds the mean of each recorded value since the last log line (NaN values skipped; a value that was
        NaN at every step is left out)."""
        for key, values in self._kvpop_logs.items():
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                logs[key] = sum(finite) / len(finite)
        self._kvpop_logs = {}
        return super().log(logs) if start_time is None else super().log(logs, start_time)

    def create_optimizer(self, model=None):
        lr = self.parts_learning_rate()
        if self.optimizer is None and lr is not None:
            self.optimizer = two_group_optimizer(self, self.part_names, lr)
            return self.optimizer
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    # -- checkpoints: the model files and the parts' files in one directory ---------------------------
    @contextmanager
    def model_files_only(self, base):
        """Inside the ``with``: ``base`` without its parts and with ``"sdpa"`` in its config (the saved config loads
        anywhere); yields ``{name: part}``. Both are restored on leaving, also on an error."""
        parts = {}
        attn = base.config._attn_implementation
        try:
            for name in self.part_names:
                parts[name] = base._modules.pop(name) if name in base._modules else base._parameters.pop(name)
            base.config._attn_implementation = "sdpa"
            yield parts
        finally:
            base.config._attn_implementation = attn
            for name, part in parts.items():
                if isinstance(part, nn.Parameter):
                    base.register_parameter(name, part)
                else:
                    base.add_module(name, part)

    def _save(self, output_dir=None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.trains_backbone:  # the backbone is the unchanged base model: save what training made
            self._save_parts_only(output_dir)
            return
        if state_dict is None:
            state_dict = self.model.state_dict()
        state_dict = {k: v for k, v in state_dict.items() if not any(name in k for name in self.part_names)}
        with self.model_files_only(unwrap_model(self.model)) as parts:
            super()._save(output_dir, state_dict=state_dict)
        self.save_parts(output_dir, parts)

    def _save_parts_only(self, output_dir):
        """The parts and the tokenizer; no copy of the frozen backbone."""
        if not self.args.should_save:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        base = unwrap_model(self.model)
        self.save_parts(output_dir, {name: getattr(base, name) for name in self.part_names})
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def save_merged_model(self, output_dir=None, dtype: torch.dtype | None = None):
        """Write a plain model directory: LoRA adapters merged into the weights (``merge_and_unload``, the
        trainer's model is replaced by the merged one), ``config.json`` + ``model.safetensors`` (weights cast
        to ``dtype`` if given), the tokenizer and the parts' files, so ``AutoModelForCausalLM.from_pretrained(d)``
        loads the student."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.is_world_process_zero():
            return
        model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
            self.model = model
        base = unwrap_model(model)
        with self.model_files_only(base) as parts:
            save_weights_as(base, output_dir, dtype)
        for name in ("adapter_model.safetensors", "adapter_config.json"):  # a stale adapter would shadow the model
            (Path(output_dir) / name).unlink(missing_ok=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        self.save_parts(output_dir, parts)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self.trains_backbone:  # a parts-only checkpoint holds no backbone: the loaded one is unchanged
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        self.load_parts(resume_from_checkpoint)


def _copy_without(base: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """A deep copy of ``base`` without the attributes ``names``."""
    teacher = copy.deepcopy(base)
    for name in names:
        if hasattr(teacher, name):
            delattr(teacher, name)
    return teacher


def two_group_optimizer(trainer: Trainer, names: tuple[str, ...], lr: float):
    """The trainer's optimizer class over two groups: the trainable parameters whose name contains one of
    ``names`` (learning rate ``lr``, no weight decay; a scorer or a gate) and every other trainable one
    (the trainer's learning rate and weight decay; LoRA adapters or the backbone)."""
    own = [p for n, p in trainer.model.named_parameters() if p.requires_grad and any(k in n for k in names)]
    ids = {id(p) for p in own}
    other = [p for p in trainer.model.parameters() if p.requires_grad and id(p) not in ids]
    optim_cls, optim_kwargs = Trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    groups = [{"params": own, "lr": lr, "weight_decay": 0.0}]
    if other:
        groups.append({"params": other, "weight_decay": trainer.args.weight_decay})
    return optim_cls(groups, **optim_kwargs)
