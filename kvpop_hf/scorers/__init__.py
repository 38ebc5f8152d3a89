"""Scorers that rank cached tokens for eviction, selectable by name: KVpop's learned scorers (:mod:`.mlp`,
:mod:`.mlstm`) live here, the baselines' in :mod:`kvpop_hf.baselines`."""

from __future__ import annotations

from ..baselines.attention_policies.policies import AttentionPolicy, H2OPolicy, SnapKVPolicy, TOVAPolicy
from ..baselines.heuristics import KNormScorer, RandomScorer, StreamingScorer
from ..baselines.keydiff import KeyDiffScorer
from ..baselines.kvp.scorer import KVPScorer
from ..baselines.lagkv import LagKVScorer
from .base import Scorer
from .mlp import MLPScorer
from .mlstm import MLSTMScorer

SCORERS: dict[str, type[Scorer]] = {
    "streaming": StreamingScorer,
    "knorm": KNormScorer,
    "keydiff": KeyDiffScorer,
    "lagkv": LagKVScorer,
    "random": RandomScorer,
    "mlp": MLPScorer,
    "mlstm": MLSTMScorer,
    "tova": TOVAPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "kvp": KVPScorer,
}


def build_scorer(name: str, num_layers: int, num_kv_heads: int, head_dim: int, **kwargs) -> Scorer:
    """Instantiate a scorer by name for a model of the given shape."""
    if name not in SCORERS:
        raise ValueError(f"Unknown scorer {name!r}. Available scorers: {sorted(SCORERS)}; or pass a `Scorer` module.")
    return SCORERS[name](num_layers, num_kv_heads, head_dim, **kwargs)


def scorer_name(scorer: Scorer) -> str:
    for name, cls in SCORERS.items():
        if type(scorer) is cls:
            return name
    return type(scorer).__name__


__all__ = ["Scorer", "SCORERS", "build_scorer", "scorer_name", "StreamingScorer", "KNormScorer", "KeyDiffScorer", "LagKVScorer",
           "RandomScorer",
           "MLPScorer", "MLSTMScorer", "AttentionPolicy", "TOVAPolicy", "H2OPolicy", "SnapKVPolicy", "KVPScorer"]
