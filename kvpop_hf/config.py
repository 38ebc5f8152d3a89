"""Configuration of a KVpop cache: the budget, the scorer and the model shape it serves."""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass, field
from typing import Any


def check_int(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """``value`` as an int ``>= minimum`` (integer-like values such as numpy ints are accepted, booleans
    are not), else a ValueError that names ``name`` and adds ``hint``."""
    if isinstance(value, bool):
        raise ValueError(f"`{name}` must be an integer, got {value!r} (bool). {hint}".rstrip())
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}). {hint}".rstrip()) \
            from None
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}. {hint}".rstrip())
    return int(value)


class JsonConfig:
    """``to_dict`` / ``to_json_string`` / ``from_dict`` of a dataclass configuration; ``from_dict`` refuses
    unknown keys, naming them (``_KIND`` names the configuration in the message)."""

    _KIND = "config"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown {cls._KIND} keys {unknown}; known keys are {sorted(known)}.")
        return cls(**data)


@dataclass
class KVpopConfig(JsonConfig):
    """Budget and scorer of a KVpop cache (KVpop, arXiv:2607.05061, Eq. 1: B = s + w + k).

    Per layer and KV head the cache keeps `sinks` first tokens, the `window` most recent
    tokens and `topk` long-range tokens chosen by a static priority
    `p_t = r_t - floor(t / decay_step) * log_gamma_h` (see docs/design.md §1).
    """

    _KIND = "KVpop config"

    sinks: int = 4
    window: int = 256
    topk: int = 1788
    scorer: str = "knorm"
    scorer_kwargs: dict = field(default_factory=dict)
    # Recency decay: None disables it; a float sets log(gamma) for every head (must be < 0).
    log_gamma: float | None = None
    decay_step: int = 64
    # Layers: "window" keeps transformers' sliding-window cache on sliding layers, "kvpop" budgets them too.
    sliding_layers: str = "window"
    # Model shape (filled from the model config; checked against the model at first use). num_layers counts the
    # KVpop layers (the scorer's layers); `layers` lists their indices among the model's decoder layers and
    # `layer_types` the model's layer pattern (None: every layer is a full-attention KVpop layer).
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    layers: list | None = None
    layer_types: list | None = None
    base_model: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def budget(self) -> int:
        return self.sinks + self.window + self.topk

    def validate(self) -> None:
        check_int("sinks", self.sinks, 0, "Use 0 to disable attention sinks.")
        check_int("window", self.window, 1, "The protected recent window needs at least the current token.")
        check_int("topk", self.topk, 0, "Use 0 for a pure sinks + window (StreamingLLM-like) cache.")
        check_int("decay_step", self.decay_step, 1, "It is the block size n of the recency decay floor(t/n).")
        if self.log_gamma is not None:
            if not isinstance(self.log_gamma, (int, float)) or not self.log_gamma < 0:
                raise ValueError(
                    f"`log_gamma` must be a negative float (log of a decay factor in (0, 1)) or None, got {self.log_gamma!r}."
                )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, 1, "It describes the model the cache serves.")
        if self.sliding_layers not in ("window", "kvpop"):
            raise ValueError(f"`sliding_layers` must be 'window' (transformers' sliding-window cache on sliding "
                             f"layers) or 'kvpop' (a KVpop budget on them too), got {self.sliding_layers!r}.")
        if self.layers is not None:
            if self.num_layers is not None and len(self.layers) != self.num_layers:
                raise ValueError(f"`layers` lists {len(self.layers)} KVpop layers but `num_layers` is "
                                 f"{self.num_layers}.")
            self.layers = [check_int("layers[i]", i, 0) for i in self.layers]
        if not isinstance(self.scorer, str):
            raise ValueError(f"`scorer` must be a scorer name, got {type(self.scorer).__name__}.")



def model_config_of(model_or_config, who: str = "KVpopCache"):
    """The model config to build a cache from: a config as is (None stays None), a model (a ``PreTrainedModel`` or
    any module with a ``PretrainedConfig`` as ``.config``, e.g. a PEFT wrapper) gives its ``.config``. Anything
    else is a TypeError naming what was passed."""
    from transformers import PretrainedConfig

    if model_or_config is None or isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if isinstance(config, PretrainedConfig):
        return config
    if hasattr(model_or_config, "num_hidden_layers"):  # a config-like object (duck typing)
        return model_or_config
    raise TypeError(f"{who} needs the model's config (a transformers PretrainedConfig) or the model itself as first "
                    f"argument, got {type(model_or_config).__name__}: {who}(model.config, ...).")


def model_shape(model_config, sliding_layers: str = "window") -> tuple[int, int, int]:
    """(number of KVpop layers, num_kv_heads, head_dim) of a transformers decoder config.

    The KVpop layers are the full-attention layers (and the sliding-window ones with ``sliding_layers="kvpop"``),
    see :mod:`kvpop_hf.layer_types`; a ValueError names layer types KVpop cannot serve."""
    from .layer_types import layer_plan, text_config

    cfg = text_config(model_config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return len(layer_plan(cfg, sliding_layers).kvpop_layers), kv_heads, head_dim


def require_full_attention(model_config, who: str) -> None:
    """ValueError unless every layer of the model is a plain full softmax attention (for methods that serve those
    only: DMS, KVP); names the layer types and the variants found."""
    from .layer_types import layer_types_and_windows, text_config

    cfg = text_config(model_config)
    bad = sorted({t for t in layer_types_and_windows(cfg)[0] if t != "full_attention"})
    if bad:
        raise ValueError(f"{who} supports models whose layers are all full attention; this {type(cfg).__name__} has "
                         f"layer types {bad}. Use KVpopCache (docs/hybrid_models.md) or a full-attention model.")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"{who} implements a plain softmax; this {type(cfg).__name__} caps attention logits "
                         f"(attn_logit_softcapping={cfg.attn_logit_softcapping}).")
