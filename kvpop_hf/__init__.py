"""kvpop-hf: learned fixed-budget KV-cache eviction (KVpop, arXiv:2607.05061) for Hugging Face transformers.

Importing the package registers the ``"kvpop"`` attention implementation with transformers (at once where
transformers' model code is already imported, else as soon as it is: ``kvpop_hf/registration.py``), and the
baselines' scorer names in ``SCORERS`` (``kvpop_hf/baselines/__init__.py``, by path). The names below are imported on first use, so ``import kvpop_hf`` loads neither transformers' model stack nor the trainer,
the testbed, Triton or matplotlib.
"""

from importlib import import_module

from . import baselines  # noqa: F401  (the baselines register their scorers in SCORERS, by path)
from .registration import register_attention, register_when_transformers_loads

register_when_transformers_loads()

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Backends": ".backends",
    "KVpopCache": ".cache",
    "KVpopConfig": ".config",
    "fuse_projection_storage": ".ops.fused_projections",
    "fused_compile_config": ".ops.fused_projections",
    "prefill_in_chunks": ".prefill",
    "generate_batch": ".batch",
    "generate_batch_stream": ".batch",
    "BatchRequest": ".batch",
    "BatchOutput": ".batch",
    "run_ahead_sample": ".run_ahead",
    "SCORERS": ".scorer_registry",
    "register_scorer": ".scorer_registry",
    "Scorer": ".scorers",
    "build_scorer": ".scorers",
    "KVpopTrainer": ".trainer",
    "KVpopTrainingArguments": ".trainer",
    "DMSCache": ".baselines.dms",  # the DMS baseline
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpop_hf' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["Backends", "KVpopCache", "KVpopConfig", "fuse_projection_storage", "fused_compile_config",
           "prefill_in_chunks", "generate_batch", "generate_batch_stream", "BatchRequest", "BatchOutput",
           "run_ahead_sample", "Scorer", "SCORERS", "register_scorer", "build_scorer",
           "KVpopTrainer", "KVpopTrainingArguments", "register_attention"]
__version__ = "0.1.0"
