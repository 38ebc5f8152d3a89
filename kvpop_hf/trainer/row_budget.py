"""Training rows against the budget ``B = s + w + k``: a row of at most ``B`` tokens evicts nothing.

Each query attends to at most ``B`` keys, and query ``t`` of a row has ``t + 1`` keys to choose from, so in a row
of ``n <= B`` tokens every query sees every earlier token: the student is the dense teacher, the distillation loss
is 0, no token reaches a boundary (no boundary loss), and the row trains nothing. Rows of different lengths are
trained one document per row (padded on the right, the padding masked), so this holds row by row within a batch.

:func:`check_rows_exceed_budget` runs before training starts (KVpopTrainer's constructor; ``kvpop-retrofit``
before the model loads):

* every row known (a ``datasets.Dataset``, whose ``input_ids`` lengths are read from Arrow at once; a list; a
  map-style dataset of at most :data:`ROW_SCAN` rows) and none longer than ``B``: a ValueError naming the budget,
  the longest row and the fix;
* at least :data:`WARN_SHARE` of the rows looked at within the budget, or only the first rows of a larger dataset
  or a stream looked at and all within it: a warning (the longer rows do train; the covered ones dilute the
  per-token mean of the loss and cost a step's compute for nothing).
"""

from __future__ import annotations

import warnings

ROW_SCAN = 4096  # rows read from a map-style dataset that is not a list or datasets.Dataset (rows may be costly)
STREAM_SCAN = 64  # rows read from a stream (an IterableDataset) before training
WARN_SHARE = 0.5  # warn when at least this share of the rows looked at is within the budget



def python_fix(budget: int) -> str:
    """The remedy, in KVpopTrainer's terms (``kvpop-retrofit`` names its flags instead)."""
    return (f"rows longer than {budget} tokens (longer documents, or a larger KVpopDataArguments seq_len / "
            f"max_length where they cut or drop the longer rows; min_length={budget + 1} keeps only rows that "
            "evict), or lower the budget (KVpopTrainingArguments sinks / window / topk)")


def _length(ids) -> int:
    if isinstance(ids, (list, tuple)) and not (ids and isinstance(ids[0], (list, tuple))):
        return len(ids)
    if hasattr(ids, "numel"):
        return int(ids.numel())
    import numpy as np

    return int(np.size(ids))


def row_lengths(data, partial: bool = True) -> tuple[list[int], bool] | None:
    """``(lengths, every_row)``: the ``input_ids`` lengths of the rows looked at, and whether those are all the rows;
    None when the rows hold no ``input_ids`` (a custom collator builds them) or cannot be read, or, without
    ``partial``, when not every row would be read (nothing is read then)."""
    if data is None:
        return None
    if type(data).__module__.startswith("datasets.") and hasattr(data, "column_names"):
        if hasattr(data, "__len__"):  # a datasets.Dataset: the list lengths from Arrow, every row
            if "input_ids" not in (data.column_names or []):
                return None
            import pyarrow as pa
            import pyarrow.compute as pc

            column = data.with_format("arrow")["input_ids"]
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                if not pa.types.is_list(column.type.value_type):
                    return [int(n) for n in pc.list_value_length(column).to_pylist()], True
            return [_length(r) for r in data["input_ids"]], True
        if not partial:
            return None
        rows, every = list(data.take(STREAM_SCAN)), False  # a stream: its first rows
    elif isinstance(data, (list, tuple)):
        rows, every = data, True
    elif hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        n = len(data)
        if n > ROW_SCAN and not partial:
            return None
        rows, every = [data[i] for i in range(min(n, ROW_SCAN))], n <= ROW_SCAN
    else:  # a torch IterableDataset or another iterable: its order may matter, leave it alone
        return None
    if not rows or not all(isinstance(r, dict) and "input_ids" in r for r in rows):
        return None
    return [_length(r["input_ids"]) for r in rows], every


def check_rows_exceed_budget(data, sinks: int, window: int, topk: int, fix=python_fix, warn: bool = True) -> None:
    """A ValueError when no training row of ``data`` is longer than ``sinks + window + topk`` (nothing would be
    evicted, the loss would be 0 at every step); with ``warn``, a warning when most rows looked at are within it
    (see the module docstring). ``fix(budget)`` names the remedy."""
    found = row_lengths(data, partial=warn)  # what is not read whole can only give a warning
    if found is None or not found[0]:
        return
    lengths, every = found
    budget = sinks + window + topk
    covered = sum(n <= budget for n in lengths)
    longest = max(lengths)
    where = f"s + w + k = {sinks} + {window} + {topk} = {budget} tokens"
    remedy = fix(budget)
    if covered == len(lengths) and every:
        raise ValueError(f"the KVpop budget {where} covers every training row (the longest has {longest} tokens): "
                         "nothing is ever evicted, so the student is the dense teacher and the loss is 0 at every "
                         f"step. Train on {remedy}.")
    if not warn:
        return
    from ..stacklevel import user_stacklevel

    if covered == len(lengths):
        warnings.warn(f"the KVpop budget {where} covers each of the first {len(lengths)} training rows read (the "
                      f"longest has {longest} tokens): a row within the budget evicts nothing and trains nothing. "
                      f"If the later rows are no longer, the loss is 0 at every step: train on {remedy}.",
                      stacklevel=user_stacklevel())
    elif covered >= WARN_SHARE * len(lengths):
        what = "training rows" if every else f"first {len(lengths)} training rows read"
        warnings.warn(f"{covered} of the {len(lengths)} {what} ({covered / len(lengths):.0%}) are no longer than "
                      f"the KVpop budget {where} (the longest row has {longest}): they evict nothing and train "
                      f"nothing (only the longer rows give a loss). For more signal per step, train on {remedy}.",
                      stacklevel=user_stacklevel())
