"""Scorers that rank cached tokens for eviction, selectable by name: KVpop's learned scorers (:mod:`.mlp`,
:mod:`.mlstm`) live here, the baselines' in :mod:`kvpop_hf.baselines`, which registers them in :data:`SCORERS`
(:mod:`kvpop_hf.scorer_registry`) when ``kvpop_hf`` is imported."""

from __future__ import annotations

from ..scorer_registry import SCORERS, ScorerRegistry, register_scorer
from .base import Scorer
from .mlp import MLPScorer
from .mlstm import MLSTMScorer


def build_scorer(name: str, num_layers: int, num_kv_heads: int, head_dim: int, **kwargs) -> Scorer:
    """Instantiate a scorer by name for a model of the given shape."""
    if name not in SCORERS:
        raise ValueError(f"Unknown scorer {name!r}. Available scorers: {sorted(SCORERS)}; or pass a `Scorer` module "
                         "(or register one: kvpop_hf.register_scorer).")
    return SCORERS[name](num_layers, num_kv_heads, head_dim, **kwargs)


def scorer_name(scorer: Scorer) -> str:
    """The name ``scorer``'s class is registered under, else the class name."""
    return SCORERS.name_of(type(scorer)) or type(scorer).__name__


__all__ = ["Scorer", "SCORERS", "ScorerRegistry", "register_scorer", "build_scorer", "scorer_name", "MLPScorer",
           "MLSTMScorer"]
