"""kvpop-hf: learned fixed-budget KV-cache eviction (KVpop, arXiv:2607.05061) for Hugging Face transformers.

Importing the package registers the ``"kvpop"`` attention implementation.
"""

from .attention import register as _register_attention
from .backends import Backends
from .cache import KVpopCache
from .config import KVpopConfig
from .fused_projections import fuse_projection_storage, fused_compile_config
from .prefill import prefill_in_chunks
from .run_ahead import run_ahead_sample
from .scorers import SCORERS, Scorer, build_scorer

_register_attention()


def __getattr__(name):  # the training stack is imported on first use
    if name in ("KVpopTrainer", "KVpopTrainingArguments"):
        from . import trainer

        return getattr(trainer, name)
    if name == "DMSCache":  # the DMS baseline (kvpop_hf/baselines/dms)
        from .baselines.dms import DMSCache

        return DMSCache
    raise AttributeError(f"module 'kvpop_hf' has no attribute {name!r}")


__all__ = ["Backends", "KVpopCache", "KVpopConfig", "fuse_projection_storage", "fused_compile_config", "prefill_in_chunks", "run_ahead_sample", "Scorer", "SCORERS", "build_scorer", "KVpopTrainer", "KVpopTrainingArguments"]
__version__ = "0.1.0"
