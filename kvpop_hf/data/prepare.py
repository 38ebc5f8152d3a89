"""A raw ``datasets`` split -> training rows ``{"input_ids", "labels"}``, one document per row.

The same preparation runs for ``training/retrofit.py --dataset ...`` and for a raw ``datasets.Dataset`` handed to
``KVpopTrainer(train_dataset=..., data_args=KVpopDataArguments(...))``. Every check that can fail (a missing field,
no chat template, a row longer than ``seq_len`` without ``truncation``, an empty split, nothing left after the
length filter) fails here, before a model is needed. A streamed split is checked on its first rows here and row by
row (with the same messages) as training reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .render import check_chat_template, conversation_ids, text_ids
from .sources import is_hf_dataset

# rows of a streamed split that are read (and checked) before training starts
STREAM_PEEK = 8


@dataclass
class KVpopDataArguments:
    """Where the retrofit data comes from and how each row becomes one training document."""

    dataset: str = field(default="testbed:reasoning", metadata={
        "help": "testbed:<family>[,<family>...] (generated), a Hub dataset name (owner/name), a local dataset folder "
                "(save_to_disk, or a folder of data files) or a data file (.jsonl .json .parquet .arrow .csv)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration (name)."})
    split: str = field(default="train", metadata={"help": "Dataset split (e.g. train, high_part00)."})
    text_field: str | None = field(default=None, metadata={
        "help": "Column of plain-text documents (tokenized with the tokenizer's special tokens, EOS appended)."})
    messages_field: str | None = field(default=None, metadata={
        "help": "Column of conversations ([{'role', 'content'}, ...]) rendered by the tokenizer's chat template. "
                "Neither field given: 'messages' if the split has it, else 'text'."})
    assistant_only_loss: bool = field(default=False, metadata={
        "help": "With --messages_field: distil only on assistant-turn tokens (labels -100 elsewhere). Default "
                "False: the whole conversation, as the paper distils on whole traces."})
    chat_template_kwargs: str = field(default="{}", metadata={
        "help": "JSON dict passed to apply_chat_template, e.g. '{\"enable_thinking\": true}'."})
    seq_len: int = field(default=2048, metadata={
        "help": "Training sequence length. testbed: every row has exactly this many tokens; datasets: the longest "
                "row allowed (rows are padded to the longest of their batch; a longer row is an error unless "
                "--truncation)."})
    truncation: bool = field(default=False, metadata={
        "help": "Cut rows longer than --seq_len to their first seq_len tokens instead of stopping with an error."})
    min_length: int = field(default=0, metadata={"help": "Drop rows with fewer tokens than this."})
    max_length: int | None = field(default=None, metadata={
        "help": "Drop rows with more tokens than this (applied before the --seq_len check)."})
    preprocessing_num_workers: int | None = field(default=None, metadata={
        "help": "Processes that tokenize the split (datasets.map num_proc; not with --streaming)."})
    streaming: bool = field(default=False, metadata={
        "help": "Stream the split (datasets IterableDataset): nothing is downloaded or tokenized ahead; needs "
                "--max_steps."})

    def __post_init__(self):
        if self.text_field and self.messages_field:
            raise ValueError("give --text_field or --messages_field, not both.")
        if self.assistant_only_loss and self.text_field:
            raise ValueError("--assistant_only_loss needs conversations (--messages_field); plain text has no "
                             "assistant turns.")
        if self.seq_len < 1 or self.min_length < 0 or (self.max_length is not None and self.max_length < 1):
            raise ValueError(f"lengths must be positive: seq_len={self.seq_len}, min_length={self.min_length}, "
                             f"max_length={self.max_length}.")
        if self.max_length is not None and self.max_length < self.min_length:
            raise ValueError(f"--max_length {self.max_length} is below --min_length {self.min_length}: no row fits.")
        try:
            kw = json.loads(self.chat_template_kwargs) if isinstance(self.chat_template_kwargs, str) \
                else dict(self.chat_template_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"--chat_template_kwargs must be a JSON object: {err}") from err
        if not isinstance(kw, dict):
            raise ValueError(f"--chat_template_kwargs must be a JSON object, got {self.chat_template_kwargs!r}.")
        self.chat_template_kwargs = json.dumps(kw)


def _columns(data, first_row):
    cols = getattr(data, "column_names", None)
    return list(cols) if cols else list(first_row or {})


def choose_field(columns, args: KVpopDataArguments) -> tuple[str, bool]:
    """(column, is_messages) for ``args``; a ValueError naming the columns when the field is missing."""
    if args.messages_field or args.text_field:
        name, is_messages = (args.messages_field, True) if args.messages_field else (args.text_field, False)
        if name not in columns:
            flag = "--messages_field" if is_messages else "--text_field"
            raise ValueError(f"{flag} {name!r} is not a column of the dataset; its columns are {columns}.")
        return name, is_messages
    if "messages" in columns:
        return "messages", True
    if "text" in columns:
        return "text", False
    raise ValueError(f"the dataset has neither a 'messages' nor a 'text' column (columns: {columns}): name the column "
                     "with --messages_field (conversations) or --text_field (plain text).")


class RowEncoder:
    """Picklable ``row -> {"input_ids", "labels", "length"}`` for ``datasets.map`` (``length``: tokens before any
    truncation)."""

    def __init__(self, tokenizer, column: str, is_messages: bool, args: KVpopDataArguments):
        self.tokenizer, self.column, self.is_messages = tokenizer, column, is_messages
        self.assistant_only = args.assistant_only_loss
        self.template_kwargs = json.loads(args.chat_template_kwargs)
        self.seq_len, self.truncation = args.seq_len, args.truncation

    def __call__(self, row):
        value = row[self.column]
        if self.is_messages:
            ids, labels = conversation_ids(self.tokenizer, value, self.assistant_only, self.template_kwargs)
        else:
            ids = text_ids(self.tokenizer, value)
            labels = list(ids)
        n = len(ids)
        if self.truncation:
            ids, labels = ids[:self.seq_len], labels[:self.seq_len]
        return {"input_ids": ids, "labels": labels, "length": n}


class LengthFilter:
    """Picklable ``row -> bool``: ``min_length <= length <= max_length``."""

    def __init__(self, args: KVpopDataArguments):
        self.lo, self.hi = args.min_length, args.max_length

    def __call__(self, row):
        return row["length"] >= self.lo and (self.hi is None or row["length"] <= self.hi)


def too_long_error(longest: int, count: int, seq_len: int) -> ValueError:
    return ValueError(f"{count} row(s) are longer than --seq_len {seq_len} tokens (the longest has {longest}): raise "
                      f"--seq_len, drop them with --max_length {seq_len}, or cut them with --truncation.")


class SeqLenCheck:
    """Picklable streamed-row check: a row longer than ``seq_len`` (after the length filter) without truncation."""

    def __init__(self, args: KVpopDataArguments):
        self.seq_len, self.truncation = args.seq_len, args.truncation

    def __call__(self, row):
        if not self.truncation and row["length"] > self.seq_len:
            raise too_long_error(row["length"], 1, self.seq_len)
        return row


def prepare_dataset(data, tokenizer, args: KVpopDataArguments, num_examples: int | None = None):
    """``data`` (a ``datasets`` Dataset or IterableDataset of raw rows) -> rows ``{"input_ids", "labels"}`` of at
    most ``args.seq_len`` tokens, one document each; ``num_examples``: keep the first that many rows."""
    if not is_hf_dataset(data):
        raise TypeError(f"prepare_dataset takes a datasets.Dataset or IterableDataset, got {type(data).__name__}.")
    streaming = not hasattr(data, "__len__")
    if num_examples is not None:
        data = data.take(num_examples) if streaming else data.select(range(min(num_examples, len(data))))
    first = next(iter(data.take(1)), None) if streaming else (data[0] if len(data) else None)
    if first is None:
        raise ValueError("the dataset split is empty: check --dataset / --split (and --dataset_config).")
    columns = _columns(data, first)
    column, is_messages = choose_field(columns, args)
    if is_messages:
        check_chat_template(tokenizer)
    encode = RowEncoder(tokenizer, column, is_messages, args)
    encode(first)  # a malformed first row fails here, before any map
    if streaming:
        rows = data.map(encode, remove_columns=columns).filter(LengthFilter(args)).map(SeqLenCheck(args))
        peek = list(rows.take(STREAM_PEEK))
        if not peek:
            raise ValueError(f"no row of the first ones read passes the length filter (--min_length "
                             f"{args.min_length}, --max_length {args.max_length}).")
        return rows.remove_columns(["length"])
    workers = args.preprocessing_num_workers
    rows = data.map(encode, remove_columns=columns, desc="Tokenizing", num_proc=workers)
    kept = rows.filter(LengthFilter(args), desc="Length filter", num_proc=workers)
    if len(kept) == 0:
        raise ValueError(f"no row passes the length filter (--min_length {args.min_length}, --max_length "
                         f"{args.max_length}); the rows have {min(rows['length'])} to {max(rows['length'])} tokens.")
    lengths = kept["length"]
    over = [n for n in lengths if n > args.seq_len]
    if over and not args.truncation:
        raise too_long_error(max(over), len(over), args.seq_len)
    return kept.remove_columns(["length"])


def ensure_prepared(data, tokenizer, args: KVpopDataArguments | None):
    """``data`` as training rows: a ``datasets`` split without ``input_ids`` goes through :func:`prepare_dataset`
    (``args`` default: ``KVpopDataArguments()``); anything else (rows already tokenized, a list, a torch Dataset)
    is returned unchanged."""
    if data is None or not is_hf_dataset(data):
        return data
    columns = getattr(data, "column_names", None) or _columns(data, next(iter(data.take(1)), None))
    if "input_ids" in columns:
        return data
    if tokenizer is None:
        raise ValueError("a raw datasets split (no input_ids column) needs the tokenizer to prepare it: pass "
                         "processing_class=tokenizer to KVpopTrainer.")
    return prepare_dataset(data, tokenizer, args or KVpopDataArguments())
