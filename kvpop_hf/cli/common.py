"""What the training commands share: argument checks made before any work, the train-and-save sequence and the
process-group teardown of a command."""

from __future__ import annotations

import types
from dataclasses import dataclass

from transformers import HfArgumentParser
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from ..trainer.merged_save import merged_dtype
from ..trainer.time_budget import TimeBudget, time_decay_schedule


@dataclass
class _PrecisionFlags:
    """The two TrainingArguments flags :func:`check_bf16_device` reads, parsed ahead of the rest."""

    bf16: bool = False
    use_cpu: bool = False


def check_bf16_device(argv) -> None:
    """``--bf16`` without a GPU that has bf16 (training on the CPU): a ValueError naming the fix, before the
    arguments are parsed (where the Trainer's own check stops with "Your setup doesn't support bf16/gpu")."""
    flags, _ = HfArgumentParser(_PrecisionFlags, add_help=False).parse_known_args(args=argv)  # --help: the full parser
    if flags.bf16 and not flags.use_cpu and not is_torch_bf16_gpu_available() and not is_torch_xla_available():
        raise ValueError("--bf16 needs a GPU with bfloat16 support, and this machine has none: drop --bf16 on CPU "
                         "(training then runs in float32), or add --use_cpu True to train under CPU bf16 autocast.")


def check_time_arguments(script) -> None:
    """--lr_decay_by_time needs --max_train_seconds (checked before any work)."""
    if getattr(script, "lr_decay_by_time", False) and not script.max_train_seconds:
        raise ValueError("--lr_decay_by_time decays the learning rate over --max_train_seconds; "
                         "set --max_train_seconds too (or drop --lr_decay_by_time).")


def examples_needed(num_examples, args) -> int:
    """``num_examples`` if given, else one example per sample that ``max_steps`` steps draw."""
    return num_examples or max(1, args.max_steps) * args.per_device_train_batch_size * \
        args.gradient_accumulation_steps * max(1, args.world_size)


def train_and_save(trainer_cls, model, args, data, tokenizer, script, callbacks=None):
    """Build ``trainer_cls`` (with the ``--max_train_seconds`` budget among the callbacks), train (resuming if
    asked) and save: the LoRA merged into the weights with ``--merge_lora``, else the trainer's own save."""
    save_dtype = merged_dtype(script.merged_dtype, script.model) if script.merge_lora else None
    check_time_arguments(script)
    budget = TimeBudget(script.max_train_seconds) if script.max_train_seconds else None
    callbacks = list(callbacks or []) + ([budget] if budget else [])
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=callbacks or None)
    if getattr(script, "lr_decay_by_time", False):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = time_decay_schedule(optimizer or self.optimizer, budget,
                                                        self.args.get_warmup_steps(num_training_steps))
            return self.lr_scheduler

        trainer.create_scheduler = types.MethodType(create_scheduler, trainer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if script.merge_lora:
        trainer.save_merged_model(dtype=save_dtype)
    else:
        trainer.save_model()
    return trainer


def close_process_group(wait_for_ranks: bool = True):
    """Tear down the process group that the Trainer opened under ``torchrun`` (after a barrier unless a rank failed,
    where waiting would hang): an interpreter that exits with gloo's worker threads alive aborts ("terminate called
    without an active exception") and fails the launch although training and saving succeeded."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait_for_ranks:
            dist.barrier()
        dist.destroy_process_group()


def run_cli(main_fn, argv) -> int:
    """``main_fn(argv)``, then the process group closed (see :func:`close_process_group`); 0 (the exit status)."""
    try:
        main_fn(argv)
    except BaseException:
        close_process_group(wait_for_ranks=False)
        raise
    close_process_group()
    return 0
