"""kvpop-hf: learned fixed-budget KV-cache eviction (KVpop, arXiv:2607.05061) for Hugging Face transformers.

Importing the package registers the ``"kvpop"`` attention implementation.
"""

from .attention import register as _register_attention
from .cache import KVpopCache
from .config import KVpopConfig
from .scorers import SCORERS, Scorer, build_scorer

_register_attention()

__all__ = ["KVpopCache", "KVpopConfig", "Scorer", "SCORERS", "build_scorer"]
__version__ = "0.1.0"
