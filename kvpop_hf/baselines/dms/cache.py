"""DMSCache: a `transformers.Cache` whose per-head memory is decided by a learned gate (DMS).

Dynamic Memory Sparsification (Łańcucki et al., 2025), the learned-eviction baseline of KVpop
(arXiv:2607.05061): each new token gets a hard eviction decision per KV head from the gate
(:class:`~kvpop_hf.baselines.dms.gate.DMSGate`), a marked token is dropped once it leaves the window of the last ``w``
tokens, so each head keeps as many tokens as its gate lets it (ragged memory, unlike KVpopCache's fixed
``B`` per head). It is a class of its own rather than a KVpopCache scorer (docs/design.md §9).

Example::

    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="kvpop")
    cache = DMSCache.from_pretrained(ckpt, model.config)
    out = model.generate(ids, **with_cache(model, cache, max_new_tokens=256))  # kvpop_hf.compat
    cache.compression()  # {"kept_fraction": ..., "eviction_ratio": [layers x kv_heads], ...}
"""

from __future__ import annotations

import os

import torch
from transformers.cache_utils import Cache

from ...config import model_config_of, model_shape, require_full_attention
from ...shared import DeviceCopies
from . import config as dms_files
from .config import DMSConfig
from .gate import DMSGate
from .layer import DMSLayer


class DMSCache(Cache):
    """Args:
        model_config: the model's config (layers, KV heads, head size), or the model (its ``.config`` is taken).
        gate: a trained :class:`DMSGate` (default: a fresh gate that evicts nothing, ``bias = init_bias < 0``).
        sinks, window: never-evicted first tokens and the delayed-eviction window ``w``.
        dms_config: a :class:`DMSConfig` instead of ``sinks``/``window``.
    Needs ``attn_implementation="kvpop"`` (the heads keep different tokens); a stock attention raises.
    """

    def __init__(self, model_config, gate: DMSGate | None = None, sinks: int = 4, window: int = 32,
                 dms_config: DMSConfig | None = None, init_bias: float = -2.0):
        model_config = model_config_of(model_config, "DMSCache")
        require_full_attention(model_config, "DMSCache")
        layers, heads, head_dim = model_shape(model_config)
        cfg = dms_config if dms_config is not None else DMSConfig(sinks=sinks, window=window)
        cfg.validate()
        for name, value in (("num_layers", layers), ("num_kv_heads", heads), ("head_dim", head_dim)):
            stored = getattr(cfg, name)
            if stored is not None and stored != value:
                raise ValueError(f"This DMS gate was made for {name}={stored}, but the model has {name}={value}.")
            setattr(cfg, name, value)
        if gate is None:
            gate = DMSGate(layers, heads, head_dim, init_bias=init_bias)
        if (gate.num_layers, gate.num_kv_heads, gate.head_dim) != (layers, heads, head_dim):
            raise ValueError(f"Gate shape (layers={gate.num_layers}, kv_heads={gate.num_kv_heads}, head_dim="
                             f"{gate.head_dim}) does not match the model ({layers}, {heads}, {head_dim}).")
        self.dms_config = cfg
        self._gates = DeviceCopies(gate.requires_grad_(False).eval())  # shared read-only by deep copies
        super().__init__(layers=[DMSLayer(cfg, self._gates, i) for i in range(layers)])

    def __repr__(self) -> str:
        cfg = self.dms_config
        return f"{type(self).__name__}(sinks={cfg.sinks}, window={cfg.window}, layers={len(self.layers)})"

    @property
    def gate(self) -> DMSGate:
        return self._gates.module

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"The model updates layer {layer_idx}, but this DMSCache has {len(self.layers)} layers: "
                             "build it from this model's config.")
        if layer_idx > 0:  # the layer below attended just before: a stock attention is caught in this forward
            self.layers[layer_idx - 1].flush()
        else:
            self.layers[-1].flush()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # -- what the cache holds ----------------------------------------------------------------------
    def _ready(self) -> list[DMSLayer]:
        for layer in self.layers:
            layer.flush()
        return [layer for layer in self.layers if layer.is_initialized]

    def kept_counts(self) -> torch.Tensor:
        """Live entries ``[layers, batch, kv_heads]``."""
        layers = self._ready()
        if len(layers) != len(self.layers):
            raise ValueError("The DMSCache is empty: run the model with it first.")
        return torch.stack([layer.live() for layer in layers]).cpu()

    def compression(self) -> dict:
        """Per-head memory after the tokens seen so far: ``kept [layers, batch, kv_heads]`` live entries,
        ``seen [batch]`` real tokens, ``kept_fraction`` = mean over layers, rows and heads of kept / seen (the
        achieved average memory; compression = 1 - kept_fraction), ``eviction_ratio [layers, kv_heads]`` = the
        fraction of tokens ``t >= sinks`` marked for eviction, averaged over rows (0: dense, 1: window only)."""
        kept = self.kept_counts().float()
        seen = self.layers[0].seen.cpu().float()
        gated = (seen - self.dms_config.sinks).clamp_min(1)
        marked = torch.stack([layer.marked for layer in self.layers]).cpu().float()  # [layers, b, h]
        return {"kept": kept, "seen": seen, "kept_fraction": float((kept / seen.clamp_min(1)[None, :, None]).mean()),
                "eviction_ratio": (marked / gated[None, :, None]).mean(1)}

    def memory_bytes(self) -> int:
        """Bytes of the tensors the layers hold (keys, values, positions, decisions, counters)."""
        total = 0
        for layer in self._ready():
            for t in (layer.keys, layer.values, layer.pos, layer.evict, layer.seen, layer.marked, layer.tokens):
                total += t.numel() * t.element_size()
        return total

    def stored_positions(self, layer_idx: int) -> torch.Tensor:
        """Positions per slot ``[batch, kv_heads, N]`` (-1: free)."""
        self.layers[layer_idx].flush()
        return self.layers[layer_idx].pos

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        dms_files.save(save_directory, self.dms_config, self.gate)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, model_config=None) -> "DMSCache | DMSPrototype":
        """The cache for ``model_config`` (or, without it, a :class:`DMSPrototype` that makes caches later)."""
        cfg, state = dms_files.load(directory)
        if cfg.num_layers is None:
            raise ValueError(f"{directory}: the DMS config lacks the model shape.")
        gate = DMSGate(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        try:
            gate.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"The gate weights in {directory} do not fit its config: {err}") from err
        proto = DMSPrototype(cfg, gate, str(directory))
        return proto if model_config is None else proto.make(model_config)


class DMSPrototype:
    """A loaded DMS checkpoint (config and gate, shared read-only by the caches it makes)."""

    def __init__(self, dms_config: DMSConfig, gate: DMSGate, source: str = ""):
        self.dms_config, self.gate, self.source = dms_config, gate, source

    def make(self, model_config) -> DMSCache:
        cfg = DMSConfig(**{k: getattr(self.dms_config, k) for k in self.dms_config.__dataclass_fields__})
        return DMSCache(model_config, gate=self.gate, dms_config=cfg)
