"""Retrofit data: Hugging Face ``datasets`` sources, one document per row, the padding collator, and traces
sampled from the model itself (:mod:`.traces`). ``datasets`` is imported only when a source is loaded."""

from .collator import KVpopDataCollator
from .prepare import KVpopDataArguments, prepare_dataset
from .render import check_chat_template, conversation_ids, text_ids
from .sources import is_hf_dataset, load_source, require_datasets

__all__ = ["KVpopDataArguments", "KVpopDataCollator", "prepare_dataset", "load_source", "require_datasets",
           "is_hf_dataset", "conversation_ids", "text_ids", "check_chat_template"]
