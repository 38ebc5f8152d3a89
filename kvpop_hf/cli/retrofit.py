"""Retrofit a causal LM with KVpop scorers at a fixed budget (command-line front end of KVpopTrainer).

Examples::

    # the testbed teacher, generated reasoning traces, mLSTM scorer at B = 4 + 64 + 188
    python training/retrofit.py --model checkpoints/testbed-4k-teacher --dataset testbed:reasoning --seq_len 2048 \
        --sinks 4 --window 64 --topk 188 --scorer mlstm --output_dir out/kvpop --max_steps 200

    # StreamingLLM+ (trained-window baseline): sinks + window only, the LoRA backbone distilled at B = 4 + 252
    python training/retrofit.py --model checkpoints/testbed-4k-teacher --dataset testbed:reasoning --seq_len 1024 \
        --sinks 4 --window 252 --topk 0 --scorer streaming --lora_rank 8 --merge_lora True \
        --output_dir checkpoints/streaming_plus_cr75 --max_steps 120

    # your own model on conversations from the Hub, rendered by its chat template, on several GPUs
    accelerate launch --config_file training/accelerate_ddp.yaml training/retrofit.py \
        --model Qwen/Qwen3-8B --dataset nvidia/Nemotron-Math-v2 --split high_part00 --messages_field messages \
        --seq_len 16384 --max_length 16384 --topk 1788 --output_dir out/q8b --max_steps 2000 --bf16

    # a local dataset folder (save_to_disk or data files) or a .jsonl/.parquet/.arrow/.csv file with a "text" column
    python training/retrofit.py --model my-model --dataset data.jsonl --text_field text --seq_len 4096 ...

The same command is installed as ``kvpop-retrofit``.

Dataset rows are prepared by kvpop_hf.data (docs/retrofit_your_model.md): one document per training row, padded on
the right to the longest of its batch. All `KVpopDataArguments`, `KVpopTrainingArguments` and `TrainingArguments`
flags are accepted (``--help`` lists them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from ..data import KVpopDataArguments, load_source, prepare_dataset
from ..data.generated import check_generated, generated_rows, generator_for
from ..trainer import KVpopTrainer, KVpopTrainingArguments
from ..trainer.lora import lora_student, require_peft
from ..trainer.merged_save import check_merged_dtype
from ..trainer.row_budget import check_rows_exceed_budget
from .common import check_bf16_device, check_time_arguments, examples_needed, run_cli, train_and_save


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "Model directory or Hub id (loaded with AutoModelForCausalLM)."})
    num_examples: int | None = field(default=None, metadata={
        "help": "testbed: examples to build (default: enough for max_steps); datasets: use the first this many "
                "rows of the split (default: all)."})
    problem_seed: int = field(default=1234, metadata={"help": "Seed of the generated testbed problems."})
    knob: list[str] = field(default_factory=list, metadata={
        "help": "Generator knobs of the testbed problems, FAMILY.KEY=VALUE (several after one --knob), "
                "as kvpop-eval's --knob: e.g. --knob reasoning.n_facts=10 reasoning.steps=4."})
    lora_rank: int = field(default=0, metadata={"help": ">0: train a LoRA student (teacher = adapters disabled)."})
    merge_lora: bool = field(default=False, metadata={
        "help": "Save the LoRA merged into the weights (a plain model directory) instead of the adapter."})
    dtype: str = field(default="float32", metadata={"help": "Model weights dtype: float32 | bfloat16."})
    merged_dtype: str = field(default="source", metadata={
        "help": "With --merge_lora, the dtype of the saved weights: source (the dtype the --model checkpoint "
                "records; float32 if none), float32, bfloat16 or float16."})
    max_train_seconds: float | None = field(default=None, metadata={
        "help": "Stop training (and save) after the first optimizer step that ends this many seconds after training "
                "began (the first step, compilation included, counts), whatever max_steps says."})
    lr_decay_by_time: bool = field(default=False, metadata={
        "help": "With --max_train_seconds: after the warmup steps, decay the learning rate linearly to 0 over the "
                "remaining seconds (kvpop_hf/trainer/time_budget.py) instead of using --lr_scheduler_type over "
                "max_steps, which a time budget usually cuts short."})


def build_data(data_args, script, args, tokenizer):
    """The training rows: a generated source (``NAME:SPEC``, :mod:`kvpop_hf.data.generated`), or a ``datasets``
    source prepared by :func:`kvpop_hf.data.prepare_dataset` (every data error raised here, before the model loads)."""
    if generator_for(data_args.dataset) is not None:
        return generated_rows(data_args.dataset, tokenizer, data_args.seq_len,
                              examples_needed(script.num_examples, args), script.problem_seed, script.knob)
    if data_args.streaming and args.max_steps <= 0:
        raise ValueError("--streaming reads the split as a stream of unknown length: set --max_steps.")
    raw = load_source(data_args.dataset, data_args.dataset_config, data_args.split, data_args.streaming)
    return prepare_dataset(raw, tokenizer, data_args, num_examples=script.num_examples)


def budget_fix(data_args, budget: int) -> str:
    """What makes the rows longer than ``budget`` tokens, in this command's flags."""
    lower = "or lower the budget (--sinks / --window / --topk)"
    if generator_for(data_args.dataset) is not None:
        return f"rows longer than {budget} tokens: every generated row has --seq_len {data_args.seq_len} tokens, " \
               f"so a --seq_len above {budget}, {lower}"
    causes = []
    if data_args.max_length is not None and data_args.max_length <= budget:
        causes.append(f"--max_length {data_args.max_length} drops every longer row")
    if data_args.truncation and data_args.seq_len <= budget:
        causes.append(f"--truncation cuts every row to --seq_len {data_args.seq_len}")
    why = f" ({'; '.join(causes)}: raise it)" if causes else ""
    return f"rows longer than {budget} tokens{why}: longer documents, --min_length {budget + 1} to keep only the " \
           f"rows that evict, {lower}"


def train(argv=None, callbacks=None):
    """Parses `argv`, builds the data, trains and saves; `callbacks`: extra `TrainerCallback`s. Returns the trainer."""
    check_bf16_device(argv)
    parser = HfArgumentParser((ScriptArguments, KVpopDataArguments, KVpopTrainingArguments))
    script, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    check_time_arguments(script)  # before any work
    if generator_for(data_args.dataset) is not None:
        check_generated(data_args.dataset, script.knob)  # before the tokenizer loads
    elif script.knob:
        raise ValueError(f"--knob sets the knobs of a generated source; --dataset {data_args.dataset!r} is not "
                         "NAME:SPEC of one (e.g. testbed:reasoning).")
    if script.lora_rank > 0:
        require_peft()  # before loading anything
    if script.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {script.dtype!r}.")
    check_merged_dtype(script.merged_dtype)  # before any work
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    data = build_data(data_args, script, args, tokenizer)  # data errors before the model loads
    check_rows_exceed_budget(data, args.sinks, args.window, args.topk, fix=lambda b: budget_fix(data_args, b),
                             warn=False)  # the trainer warns
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[script.dtype]
    model = AutoModelForCausalLM.from_pretrained(script.model, dtype=dtype)
    trainer = train_and_save(KVpopTrainer, lora_student(model, script.lora_rank), args, data, tokenizer, script,
                             callbacks)
    trainer.create_model_card(dataset=data_args.dataset, reference_length=data_args.seq_len)
    if args.push_to_hub:
        trainer.push_to_hub()
    return trainer


def main(argv=None) -> int:
    """The ``kvpop-retrofit`` command (``training/retrofit.py``): :func:`train`, then the process group closed."""
    return run_cli(train, argv)
