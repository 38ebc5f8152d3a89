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

Dataset rows are prepared by kvpop_hf.data (docs/retrofit_your_model.md): one document per training row, padded on
the right to the longest of its batch. All `KVpopDataArguments`, `KVpopTrainingArguments` and `TrainingArguments`
flags are accepted (``--help`` lists them).
"""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from kvpop_hf.data import KVpopDataArguments, load_source, prepare_dataset
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments
from kvpop_hf.trainer.merged_save import check_merged_dtype, merged_dtype
from kvpop_hf.trainer.time_budget import TimeBudget, time_decay_schedule


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


def testbed_examples(families, tokenizer, seq_len, n, seed, knobs=None):
    """``n`` teacher-forced examples of exactly ``seq_len`` tokens; ``knobs``: ``{family: {knob: value}}``."""
    from kvpop_hf.testbed import make_problem, training_example

    rng = random.Random(seed)
    out = []
    while len(out) < n:
        family = families[len(out) % len(families)]
        problem = make_problem(family, length=seq_len, seed=rng.randrange(1 << 30), **(knobs or {}).get(family, {}))
        ex = training_example(problem, tokenizer, mode="trace")
        ids, labels = ex["input_ids"], ex["labels"]
        if len(ids) < seq_len:
            continue  # generator undershot: skip rather than pad
        out.append({"input_ids": torch.tensor(ids[:seq_len]), "labels": torch.tensor(labels[:seq_len])})
    return out


def require_peft():
    """The ``peft`` module, or an ImportError that names the extra that installs it."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("--lora_rank needs the `peft` package: pip install -e \".[train]\" (or pip install "
                          "peft).") from err
    return peft


def lora_student(model, rank: int):
    """``rank > 0``: the model with LoRA adapters (rank ``rank``, alpha ``2 * rank``) on the attention
    projections, the student whose adapter-free self is the teacher; ``rank == 0``: the model unchanged."""
    if rank <= 0:
        return model
    peft = require_peft()

    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


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


def build_data(data_args, script, args, tokenizer):
    """The training rows: generated testbed problems, or a ``datasets`` source prepared by
    :func:`kvpop_hf.data.prepare_dataset` (every data error raised here, before the model loads)."""
    if data_args.dataset.startswith("testbed:"):
        from kvpop_hf.testbed.evaluate import parse_knobs

        families = data_args.dataset.split(":", 1)[1].split(",")
        knobs = parse_knobs(script.knob, families)
        return testbed_examples(families, tokenizer, data_args.seq_len, examples_needed(script.num_examples, args),
                                script.problem_seed, knobs)
    if data_args.streaming and args.max_steps <= 0:
        raise ValueError("--streaming reads the split as a stream of unknown length: set --max_steps.")
    raw = load_source(data_args.dataset, data_args.dataset_config, data_args.split, data_args.streaming)
    return prepare_dataset(raw, tokenizer, data_args, num_examples=script.num_examples)


def main(argv=None, callbacks=None):
    """Parses `argv`, builds the data, trains and saves; `callbacks`: extra `TrainerCallback`s. Returns the trainer."""
    check_bf16_device(argv)
    parser = HfArgumentParser((ScriptArguments, KVpopDataArguments, KVpopTrainingArguments))
    script, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    check_time_arguments(script)  # before any work
    if script.knob and not data_args.dataset.startswith("testbed:"):
        raise ValueError(f"--knob sets testbed generator knobs; --dataset {data_args.dataset!r} is not "
                         "testbed:<families>.")
    if script.lora_rank > 0:
        require_peft()  # before loading anything
    if script.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {script.dtype!r}.")
    check_merged_dtype(script.merged_dtype)  # before any work
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    data = build_data(data_args, script, args, tokenizer)  # data errors before the model loads
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[script.dtype]
    model = AutoModelForCausalLM.from_pretrained(script.model, dtype=dtype)
    trainer = train_and_save(KVpopTrainer, lora_student(model, script.lora_rank), args, data, tokenizer, script,
                             callbacks)
    trainer.create_model_card(dataset=data_args.dataset, reference_length=data_args.seq_len)
    if args.push_to_hub:
        trainer.push_to_hub()
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


def run_cli(main_fn, argv):
    """``main_fn(argv)``, then the process group closed (see :func:`close_process_group`)."""
    try:
        main_fn(argv)
    except BaseException:
        close_process_group(wait_for_ranks=False)
        raise
    close_process_group()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
