"""What the layers of one cache read in common, handed to each layer at construction (no back-reference to the
cache, as transformers' ``StaticLayer(max_cache_len)`` gets its parameters): so ``copy.deepcopy(cache)`` gives
layers that belong to the copy alone.

What a deep copy copies: every per-sequence tensor (keys, values, positions, priorities, counters, the scorer's
recurrent state: they live in the layers) and the settings below. What it shares: the frozen weights of the scorer
(or DMS gate) and their per-device copies, read-only during generation (:class:`DeviceCopies`).
"""

from __future__ import annotations

import copy
import warnings

import torch

from .stacklevel import user_stacklevel


def canonical_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceCopies:
    """A frozen module (scorer or gate) and its copies on other devices, made once per device (weights stay
    float32). Layers spread over several devices (``device_map``) each read their own device's copy, so no
    weights move during generation. ``copy.deepcopy`` returns the same object: deep copies of a cache share
    these read-only weights (an in-place change of them shows in every copy)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._copies: dict = {}

    def on(self, device) -> torch.nn.Module:
        device = canonical_device(device)
        first = next(iter(self.module.parameters()), None)
        if first is None or first.device == device:
            return self.module
        replica = self._copies.get(device)
        if replica is None:
            replica = copy.deepcopy(self.module).to(device)
            self._copies[device] = replica
        return replica

    def __deepcopy__(self, memo):
        return self


class KVpopShared:
    """The settings of one KVpopCache's layers: ``config`` (a :class:`~kvpop_hf.config.KVpopConfig`), the scorer
    (:class:`DeviceCopies`), the optional per-head decay ``log_gamma [num_layers, kv_heads]`` (replaceable: the
    layers read it through :meth:`log_gamma_for`) and the once-only stock-attention warnings."""

    def __init__(self, config, scorer: torch.nn.Module, log_gamma: torch.Tensor | None = None,
                 tp_kv_heads: tuple[int, int] | None = None, backends=None):
        self.config = config
        self.backends = backends  # the cache's Backends (unresolved); each layer resolves it for its device
        self.tp_kv_heads = tp_kv_heads  # (start, stop) of this rank's KV heads under tensor parallelism, else None
        self.max_positions: int | None = None  # the model's max_position_embeddings: bounds the allocated slots
        self.scorers = DeviceCopies(scorer)
        self.log_gamma = log_gamma
        self._log_gamma_copies: dict = {}
        self.warned_stock: set[str] = set()  # reasons already warned about

    def check_shape(self, layer_idx: int, kv_heads: int, head_dim: int) -> None:
        cfg = self.config
        heads = cfg.num_kv_heads if self.tp_kv_heads is None else self.tp_kv_heads[1] - self.tp_kv_heads[0]
        if (kv_heads, head_dim) != (heads, cfg.head_dim):
            tp = (f" The model looks tensor parallel (each rank computes {kv_heads} of the {heads} KV heads): build "
                  "the cache on each rank from the loaded model, KVpopCache(model, ...) or KVpopCache(model.config, "
                  "...), not from a config loaded separately." if head_dim == cfg.head_dim and kv_heads < heads
                  and heads % kv_heads == 0 else "")
            raise ValueError(
                f"Layer {layer_idx} has {kv_heads} KV heads of size {head_dim}, but this KVpopCache was built for "
                f"{heads} heads of size {cfg.head_dim}. Build the cache from this model's config." + tp
            )

    def log_gamma_for(self, layer_idx: int, device) -> torch.Tensor | None:
        """This layer's per-head decay ``[kv_heads]`` on ``device`` (copied once per device), or None."""
        if self.log_gamma is None:
            return None
        device = canonical_device(device)
        if self.log_gamma.device == device:
            return self.log_gamma[layer_idx]
        source, copy_on_device = self._log_gamma_copies.get(device, (None, None))
        if source is not self.log_gamma:  # first use on this device, or `log_gamma` was replaced since
            copy_on_device = self.log_gamma.to(device)
            self._log_gamma_copies[device] = (self.log_gamma, copy_on_device)
        return copy_on_device[layer_idx]

    def warn_stock_attention(self, evicted: bool, padding_unseen: bool = False) -> None:
        """Warn (once for each of the two reasons) about a chunk that ran under a stock attention: ``evicted``, the
        cache had to drop tokens inside it (stored entries + chunk > budget), so its queries saw more than their
        budget; ``padding_unseen``, a batch of several rows whose position ids transformers did not pass to
        ``update``, so left padding could not be checked. A chunk that evicted nothing was attended exactly."""
        reasons = {
            "evicted": evicted and (
                "KVpopCache: a multi-token chunk is attended with a stock attention implementation while the cache "
                "evicts, so its queries see every stored entry plus all tokens of the chunk (more than the budget). "
                "Load the model with attn_implementation='kvpop' for exact per-head eviction inside chunks; "
                "single-token decoding is exact either way."),
            "padding": padding_unseen and (
                "KVpopCache: a batch of several rows is attended with a stock attention implementation, and this "
                "transformers version does not pass the position ids to the cache, so a left-padded batch cannot be "
                "recognised: its padded rows would come out wrong without an error; attn_implementation='kvpop' "
                "handles left padding exactly."),
        }
        for reason, message in reasons.items():
            if message and reason not in self.warned_stock:
                self.warned_stock.add(reason)
                warnings.warn(message, stacklevel=user_stacklevel())


def copy_layer(layer, memo: dict, shared_modules=()):
    """``copy.deepcopy`` of a cache layer: every attribute deep-copied (through ``memo``, so the settings object of
    a copied cache is copied once for all its layers) except ``shared_modules`` (frozen weights, kept as they are).
    The copy's buffers are re-tagged for CUDA graphs (``_mark_static``) where the layer has that hook."""
    clone = object.__new__(type(layer))
    memo[id(layer)] = clone
    for module in shared_modules:
        if module is not None:
            memo.setdefault(id(module), module)
    clone.__dict__.update(copy.deepcopy(layer.__dict__, memo))
    if getattr(clone, "is_initialized", False) and hasattr(clone, "_mark_static"):
        clone._mark_static()
    return clone


def map_tensors(layer, fn) -> None:
    """Replace every tensor a cache layer holds by ``fn(tensor)``: tensor attributes and the tensors of tuple/list
    attributes (a scorer's recurrent state). Modules (scorer, gate) are not tensors and stay where they are."""
    for name, value in list(vars(layer).items()):
        if isinstance(value, torch.Tensor):
            setattr(layer, name, fn(value))
        elif isinstance(value, (tuple, list)) and value and all(isinstance(x, torch.Tensor) for x in value):
            setattr(layer, name, type(value)(fn(x) for x in value))


def offload_layer(layer) -> None:
    """``CacheLayerMixin.offload`` for layers with more state than keys and values: all of it to the CPU. A hand-off
    still waiting for its attention is settled first (``flush``, as at the layer's next update)."""
    if layer.is_initialized:
        layer.flush()
        map_tensors(layer, lambda t: t.to("cpu", non_blocking=True))


def prefetch_layer(layer) -> None:
    """``CacheLayerMixin.prefetch``: all the layer's tensors back to its device (``layer.device``)."""
    if layer.is_initialized and layer.keys.device != layer.device:
        map_tensors(layer, lambda t: t.to(layer.device, non_blocking=True))
        if hasattr(layer, "_mark_static"):
            layer._mark_static()
