"""Which cache layer each decoder layer gets, from the model config's ``layer_types`` (docs/hybrid_models.md).

As transformers' ``DynamicCache`` builds ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` / ``LinearAttentionLayer``
from ``config.layer_types``, a KVpopCache puts a KVpop layer on

* every ``full_attention`` layer;
* every ``sliding_attention`` / ``chunked_attention`` layer only with ``sliding_layers="kvpop"`` (those layers then
  attend to the KVpop set *inside* their window); by default they keep transformers' own sliding-window layer;

and gives every other layer (linear attention, conv, dummy / shared-KV layers) the layer the model's default
``DynamicCache`` gives it. Layer kinds that hold keys of a form KVpop cannot evict (``hybrid``, ``indexed_attention``,
compressed attention) are refused with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING_CHOICES = ("window", "kvpop")
FULL_TYPES = ("full_attention",)
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
# layer types whose state is not a per-token key/value cache: kept as the model's default cache holds them
STATE_TYPES = ("linear_attention", "conv", "dummy", "moe", "mlp")


@dataclass(frozen=True)
class LayerPlan:
    """Per decoder layer: ``types[i]`` (transformers' layer type), ``windows[i]`` (sliding window or None) and
    ``kvpop[i]`` (whether it gets a KVpop layer). ``kvpop_layers`` lists the KVpop layers' model indices; the
    i-th of them reads scorer layer ``i``."""

    types: tuple
    windows: tuple
    kvpop: tuple

    @property
    def kvpop_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kvpop) if k]

    @property
    def num_layers(self) -> int:
        return len(self.types)


def text_config(model_config):
    if hasattr(model_config, "get_text_config"):
        try:
            return model_config.get_text_config(decoder=True)
        except TypeError:  # configs whose get_text_config takes no argument
            return model_config.get_text_config()
    return model_config


def layer_types_and_windows(cfg) -> tuple[list[str], list]:
    """transformers' per-layer types and sliding windows (``get_layer_types_and_kwargs`` where the installed
    version has it: a list of per-layer keyword dicts in recent releases, one shared dict in 5.17; else the same
    inference from ``layer_types`` / ``sliding_window``)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None and hasattr(cfg, "per_layer_config"):
        types, kwargs = get_layer_types_and_kwargs(cfg)
        if isinstance(kwargs, dict):  # transformers <= 5.17: one dict of keyword arguments for every layer
            kwargs = [kwargs if t in SLIDING_TYPES else {} for t in types]
        return list(types), [kw.get("sliding_window") for kw in kwargs]
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) is not False:
            types = ["sliding_attention"] * n
        elif getattr(cfg, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    types = ["dummy" if t in ("moe", "mlp") else t for t in types]
    windows = [getattr(cfg, "sliding_window", None) if t == "sliding_attention"
               else getattr(cfg, "attention_chunk_size", None) if t == "chunked_attention" else None for t in types]
    return list(types), windows


def layer_plan(model_config, sliding_layers: str = "window") -> LayerPlan:
    """The :class:`LayerPlan` of a transformers decoder config. ValueError for layer types KVpop does not handle,
    and where no layer would get a KVpop layer (all layers sliding-window or recurrent)."""
    if sliding_layers not in SLIDING_CHOICES:
        raise ValueError(f"`sliding_layers` must be one of {SLIDING_CHOICES}, got {sliding_layers!r}: 'window' keeps "
                         "transformers' sliding-window cache on sliding layers, 'kvpop' puts a KVpop budget on them.")
    cfg = text_config(model_config)
    types, windows = layer_types_and_windows(cfg)
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"{type(cfg).__name__} lists {len(types)} layer_types for {cfg.num_hidden_layers} layers.")
    known = FULL_TYPES + SLIDING_TYPES + STATE_TYPES
    bad = sorted({t for t in types if t not in known})
    if bad:
        raise ValueError(
            f"KVpopCache does not support the layer types {bad} of this {type(cfg).__name__} (it handles "
            f"{list(known)}): their cache is not a per-token key/value store that KVpop can evict from. Use the "
            "model's default cache (DynamicCache) for this model.")
    unsized = [i for i, (t, w) in enumerate(zip(types, windows)) if t in SLIDING_TYPES and w is None]
    if unsized:
        raise ValueError(f"This {type(cfg).__name__} has sliding-window layers {unsized} but no window size "
                         "(`sliding_window` is None): set `sliding_window` (or `use_sliding_window`) in the config, or "
                         "make those layers 'full_attention' in `layer_types`.")
    kvpop = tuple(t in FULL_TYPES or (t in SLIDING_TYPES and sliding_layers == "kvpop") for t in types)
    if not any(kvpop):
        hint = (" Its sliding-window layers already hold at most their window; pass sliding_layers='kvpop' to put a "
                "KVpop budget on them too." if any(t in SLIDING_TYPES for t in types) else "")
        raise ValueError(f"This {type(cfg).__name__} has no layer for KVpop (layer types {sorted(set(types))}).{hint}")
    return LayerPlan(tuple(types), tuple(windows), kvpop)


def config_layer_fields(plan: LayerPlan) -> dict:
    """``{layers, layer_types}`` of a :class:`~kvpop_hf.config.KVpopConfig` for this plan: both None when every
    layer is a full-attention KVpop layer (the form of checkpoints for full-attention models)."""
    if all(plan.kvpop) and all(t in FULL_TYPES for t in plan.types):
        return {"layers": None, "layer_types": None}
    return {"layers": plan.kvpop_layers, "layer_types": list(plan.types)}


def default_layers(model_config) -> list:
    """The cache layers of the model's default ``DynamicCache(config=...)``, one per decoder layer (the
    non-KVpop layers are taken from it, so they behave exactly as in the default cache)."""
    from transformers import DynamicCache

    from transformers.cache_utils import DynamicSlidingWindowLayer

    from .window_layer import WindowLayer

    layers = DynamicCache(config=model_config).layers
    if len(layers) != text_config(model_config).num_hidden_layers:
        raise ValueError("The installed transformers builds no cache layer per decoder layer from this config "
                         "(DynamicCache(config=...)); upgrade transformers to use KVpopCache with a hybrid model.")
    # transformers' fixed-size sliding-window layer (StaticCache's) in place of the growing one: the same tokens
    # attended (the last W), W slots allocated once, and compileable, so the whole cache stays compileable as a
    # KVpopCache of a full-attention model is (generate then builds the 4D masks the KVpop layers' fixed slots need
    # under a stock attention, and may compile decode steps on a GPU); WindowLayer keeps its count on the device only,
    # so a compiled decode step has no Python int that changes every step (kvpop_hf/window_layer.py)
    return [WindowLayer(max_cache_len=layer.sliding_window, sliding_window=layer.sliding_window)
            if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in layers]
