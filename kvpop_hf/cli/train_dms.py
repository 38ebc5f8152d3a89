"""Train DMS eviction gates and distil the model at a target compression (the learned baseline of KVpop).

DMS (Łańcucki et al., 2025): per-head eviction decisions from the hidden state, Gumbel-sigmoid relaxation with a
delayed-eviction window, distillation from the dense model and a ramped compression target. The target comes
from the testbed's budget: ``--compression 0.75`` at ``--seq_len 1024`` is ``B = 256`` entries per head, and
the gate is pushed to the eviction rate at which a head's *average* memory after ``seq_len`` tokens is ``B``
(``kvpop_hf.baselines.dms.target_eviction_rate``).

Example (CPU, a few minutes)::

    python training/train_dms.py --model checkpoints/testbed-4k-teacher --dataset testbed:reasoning --seq_len 1024 \
        --compression 0.75 --sinks 4 --window 32 --lora_rank 8 --output_dir checkpoints/dms_cr75 \
        --max_steps 80 --per_device_train_batch_size 2 --learning_rate 1e-3 --use_cpu

The output directory loads with ``AutoModelForCausalLM.from_pretrained(d)`` (the LoRA merged in) and
``DMSCache.from_pretrained(d, model.config)``; ``kvpop-eval --policies dms --scorer-checkpoint dms@cr75=d``.
All `DMSTrainingArguments` / `TrainingArguments` flags are accepted (``--help``). The same command is installed
as ``kvpop-train-dms``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from ..baselines.dms import target_eviction_rate
from ..baselines.dms.trainer import DMSTrainer, DMSTrainingArguments
from ..trainer.lora import lora_student
from ..trainer.merged_save import check_merged_dtype
from ..data.generated import check_generated, generated_rows, generator_for
from .common import check_bf16_device, check_time_arguments, examples_needed, run_cli, train_and_save


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "Model directory or Hub id."})
    compression: float = field(default=0.75, metadata={
        "help": "Target compression ratio cr in (0, 1): mean memory per head B = round((1 - cr) * budget_length)."})
    budget_length: int | None = field(default=None, metadata={"help": "Length the budget refers to (default seq_len)."})
    dataset: str = field(default="testbed:reasoning", metadata={"help": "testbed:<family>[,<family>...]."})
    seq_len: int = field(default=1024)
    num_examples: int | None = field(default=None)
    problem_seed: int = field(default=1234)
    knob: list[str] = field(default_factory=list, metadata={
        "help": "Generator knobs of the testbed problems, FAMILY.KEY=VALUE (several after one --knob), "
                "as kvpop-eval's --knob: e.g. --knob reasoning.n_facts=10 reasoning.steps=4."})
    lora_rank: int = field(default=8, metadata={"help": ">0: LoRA student (teacher = adapters disabled); 0: full."})
    merge_lora: bool = field(default=True, metadata={"help": "Save the LoRA merged into the weights."})
    merged_dtype: str = field(default="source", metadata={
        "help": "The dtype of the saved merged weights: source (the dtype the --model checkpoint records), "
                "float32, bfloat16 or float16."})
    max_train_seconds: float | None = field(default=None, metadata={
        "help": "Stop training (and save) after the first optimizer step that ends this many seconds after training "
                "began (the first step counts); the target then ramps up over ramp_fraction of "
                "this time (unless --ramp_seconds is given)."})
    lr_decay_by_time: bool = field(default=False, metadata={
        "help": "With --max_train_seconds: after the warmup steps, decay the learning rate linearly to 0 over the "
                "remaining seconds (as training/retrofit.py's flag of the same name)."})


def train(argv=None, callbacks=None):
    """Parses `argv`, trains the gates and the LoRA student and saves; `callbacks`: extra `TrainerCallback`s.
    Returns the trainer."""
    check_bf16_device(argv)
    parser = HfArgumentParser((ScriptArguments, DMSTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(args=argv)
    if not 0.0 < script.compression < 1.0:
        raise ValueError(f"--compression must be in (0, 1), got {script.compression}.")
    if generator_for(script.dataset) is None:
        raise ValueError(f"--dataset must be a generated source NAME:SPEC (e.g. testbed:reasoning), got "
                         f"{script.dataset!r}.")
    check_generated(script.dataset, script.knob)
    check_merged_dtype(script.merged_dtype)  # before any work
    check_time_arguments(script)
    if script.max_train_seconds and args.ramp_seconds is None:
        args.ramp_seconds = args.ramp_fraction * script.max_train_seconds
    length = script.budget_length or script.seq_len
    budget = int(round((1.0 - script.compression) * length))
    args.target_eviction = target_eviction_rate(budget, length, args.sinks, args.window)
    print(f"DMS target: B = {budget} of {length} tokens per head on average -> eviction rate "
          f"{args.target_eviction:.4f} over tokens t >= {args.sinks}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    data = generated_rows(script.dataset, tokenizer, script.seq_len, examples_needed(script.num_examples, args),
                          script.problem_seed, script.knob)
    model = AutoModelForCausalLM.from_pretrained(script.model, dtype=torch.float32)
    return train_and_save(DMSTrainer, lora_student(model, script.lora_rank), args, data, tokenizer, script, callbacks)


def main(argv=None) -> int:
    """The ``kvpop-train-dms`` command (``training/train_dms.py``): :func:`train`, then the process group closed."""
    return run_cli(train, argv)
