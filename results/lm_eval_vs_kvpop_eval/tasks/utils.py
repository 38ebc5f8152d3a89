"""Loader and metric of the kvpop testbed tasks (written by kvpop_hf.testbed.lm_eval_tasks)."""
from pathlib import Path

from kvpop_hf.testbed.lm_eval_tasks import load_jsonl, process_results  # noqa: F401


def load_docs(data_file, **_):
    return load_jsonl(Path(__file__).with_name(data_file))
