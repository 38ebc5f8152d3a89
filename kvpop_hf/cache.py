"""KVpopCache: a `transformers.Cache` with a fixed per-head budget ``B = s + w + k`` (KVpop, arXiv:2607.05061)."""

from __future__ import annotations

import os
import warnings

import torch
from transformers.cache_utils import Cache

from . import hub
from .allocation import longest_sequence, slots_for_topk
from .backends import Backends
from .config import KVpopConfig, model_config_of, model_shape
from .layer_types import config_layer_fields, default_layers, layer_plan
from .layer import KVpopLayer
from .scorers import Scorer, build_scorer, scorer_name
from .stacklevel import user_stacklevel
from .tensor_parallel import local_kv_heads, slice_heads, slice_scorer, split_model_or_config
from .shared import KVpopShared


OFFLOADING_UNSUPPORTED = (
    "KVpopCache does not support offloading=True: transformers offloads a layer right after its update, before the "
    "attention has run, but KVpopCache's 'kvpop' attention still writes into the layer (a prompt chunk is committed "
    "there), and its compiled decode steps need buffers at fixed addresses. Its memory is already fixed at "
    "sinks + window + topk entries per KV head: choose a smaller budget instead. To park a filled cache on the CPU "
    "between calls, call cache.layers[i].offload() for each layer and cache.layers[i].prefetch() before the next call."
)


class UntrainedScorerWarning(UserWarning):
    """A ``KVpopCache`` built its learned scorer (one with parameters: "mlp", "mlstm", "kvp") from a name, so the
    scorer's weights are its constructor's random initialisation. Silence it where random weights are meant (a speed
    benchmark): ``warnings.filterwarnings("ignore", category=kvpop_hf.UntrainedScorerWarning)``."""


UNTRAINED_SCORER = (
    "KVpopCache built the learned scorer {name!r} from its name, so its weights are random (untrained) and its "
    "evictions arbitrary. Load a trained scorer with KVpopCache.from_pretrained(checkpoint_dir, model.config), or pass a trained "
    "Scorer module (its state dict loaded) as scorer=...; for a training-free cache use scorer='knorm'."
)


class KVpopCache(Cache):
    """Fixed-budget KV cache: per layer and KV head, ``sinks`` first tokens, the ``window`` most recent
    tokens and ``topk`` long-range tokens won by a scorer's static priority.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvpop")
        cache = KVpopCache(model.config, sinks=4, window=256, topk=1788, scorer="knorm")
        out = model.generate(ids, **with_cache(model, cache, max_new_tokens=4096))  # kvpop_hf.compat

    For a prompt too long for one forward, fill the cache in chunks first and let ``generate`` continue
    (its decode steps stay compiled on CUDA): ``kvpop_hf.prefill_in_chunks(model, cache, ids, 16384)``.

    With ``attn_implementation="kvpop"`` every query of a multi-token chunk sees exactly its own
    fixed-budget set per head; with a stock implementation (sdpa, eager) single-token decoding is
    exact but a prompt chunk sees all of its own tokens plus the stored ones (a warning says so once the cache
    evicts), and a batch of several rows needs position ids per row (generate passes them; padding is refused).

    Args:
        model_config: the model's `PretrainedConfig` (gives layers, KV heads, head size), or the model itself
            (its ``.config`` is taken, and under tensor parallelism its device mesh), or None when a `kvpop_config`
            with the model shape is given. Under tensor parallelism (``tp_plan="auto"``) the model or its config
            tells the cache which KV heads this rank holds; the cache keeps only those and slices the scorer to them
            (``kvpop_hf/tensor_parallel.py``).
        sinks, window, topk: the budget. A ``topk`` beyond what the model's ``max_position_embeddings`` can fill
            (``max_position_embeddings - sinks - window`` tokens can ever be eligible) is capped to that, with a
            warning naming both values: the cache's ``kvpop_config.topk``, ``budget``, ``repr`` and a checkpoint it
            saves then state what it allocates, which keeps every sequence the model can take exactly as the larger
            topk would (capping changes nothing but memory, so it warns instead of refusing). A budget that cannot
            fit in the device's free memory is refused. scorer: a name from `kvpop_hf.scorers.SCORERS` or a `Scorer`;
            "tova", "h2o" and "snapkv" take their scores from the attention (docs/design.md §7) and need
            ``attn_implementation="kvpop"``.
        log_gamma, decay_step: optional recency decay shared by all heads.
        scorer_kwargs: keyword arguments of the scorer (e.g. ``{"hidden": 64}`` for "mlp").
            A learned scorer given by name ("mlp", "mlstm", "kvp": a scorer with parameters) has random weights, so
            the constructor warns (:class:`UntrainedScorerWarning`); trained ones come from :meth:`from_pretrained`
            or as a `Scorer` module.
        backends: which implementation runs each fast path, a :class:`~kvpop_hf.backends.Backends` or a dict of
            its fields (docs/backends.md; the layers run its inference fields); unset fields come from ``KVPOP_*``
            environment variables, else the device's default. A runtime choice: not part of the saved config.
        offloading: must stay False (see ``OFFLOADING_UNSUPPORTED``); each layer's ``offload()``/``prefetch()`` move
            all of its tensors (keys, values, positions, priorities, counters, scorer state).

    ``copy.deepcopy(cache)`` gives an independent cache (its own tensors, scorer state included) that shares the
    frozen scorer weights with the original.
    """

    def __init__(self, model_config=None, sinks: int = 4, window: int = 256, topk: int = 1788,
                 scorer: str | Scorer = "knorm", log_gamma: float | None = None, decay_step: int = 64,
                 scorer_kwargs: dict | None = None, kvpop_config: KVpopConfig | None = None,
                 offloading: bool = False, backends: Backends | dict | None = None, sliding_layers: str = "window"):
        if offloading:
            raise ValueError(OFFLOADING_UNSUPPORTED)
        self.backends = Backends.coerce(backends)
        model_config, model = split_model_or_config(model_config)
        model_config = model_config_of(model_config)
        if kvpop_config is None:
            name = scorer if isinstance(scorer, str) else scorer_name(scorer)
            if isinstance(scorer, Scorer) and scorer_kwargs is None:
                scorer_kwargs = scorer.config_dict()
            kvpop_config = KVpopConfig(sinks=sinks, window=window, topk=topk, scorer=name,
                                       scorer_kwargs=dict(scorer_kwargs or {}), log_gamma=log_gamma,
                                       decay_step=decay_step, sliding_layers=sliding_layers)
        else:
            kvpop_config.validate()
        # tensor parallelism: (start, stop) of the KV heads this rank computes, None when it holds them all
        self.tp_kv_heads = local_kv_heads(model_config, model) if model_config is not None else None
        self._windows = None  # the sliding window of each KVpop layer (None: full attention), from the model config
        if model_config is not None:
            shape = _check_model_shape(kvpop_config, model_config, "This KVpop checkpoint")
            self._windows = shape.pop("windows")
            for field, value in shape.items():
                setattr(kvpop_config, field, value)
            kvpop_config.base_model = kvpop_config.base_model or getattr(model_config, "_name_or_path", None) or None
        if kvpop_config.num_layers is None:
            raise ValueError("KVpopCache needs the model shape: pass the model's config as first argument.")
        cfg = kvpop_config
        if not isinstance(scorer, Scorer):
            scorer = _build(cfg)
            if any(True for _ in scorer.parameters()):  # a learned scorer built here: its weights are random
                warnings.warn(UNTRAINED_SCORER.format(name=cfg.scorer), UntrainedScorerWarning,
                              stacklevel=user_stacklevel())
        if (scorer.num_layers, scorer.num_kv_heads, scorer.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"Scorer shape (layers={scorer.num_layers}, kv_heads={scorer.num_kv_heads}, "
                f"head_dim={scorer.head_dim}) does not match the model "
                f"({cfg.num_layers}, {cfg.num_kv_heads}, {cfg.head_dim})."
            )
        if self.tp_kv_heads is not None:
            scorer = slice_scorer(scorer, *self.tp_kv_heads)
        scorer.requires_grad_(False)
        scorer.eval()
        # optional learned per-head decay [num_layers, kv_heads] (log gamma), else the config's scalar
        log_gamma = None
        if cfg.log_gamma is not None:
            log_gamma = torch.full((cfg.num_layers, scorer.num_kv_heads), float(cfg.log_gamma))
        # what every layer reads (config, scorer and its device copies, decay); the layers hold no cache reference
        self.shared = KVpopShared(cfg, scorer, log_gamma, self.tp_kv_heads, self.backends)
        self.shared.max_positions = longest_sequence(model_config)  # bounds the slots each layer allocates
        _cap_topk(cfg, self.shared.max_positions)
        # attention-based policies (TOVA, H2O, SnapKV) re-score entries every step: their own storage class
        layer_cls = self.scorer.layer_class or KVpopLayer
        if self.scorer.dynamic and cfg.log_gamma is not None:
            raise ValueError(f"`log_gamma` (recency decay of static priorities) does not apply to the attention-based "
                             f"policy {cfg.scorer!r}, whose scores change every step; leave it None.")
        super().__init__(layers=self._build_layers(model_config, layer_cls))

    def _build_layers(self, model_config, layer_cls) -> list:
        """One cache layer per decoder layer: a KVpop layer (scorer layer ``j``) at each of ``config.layers``, the
        model's default ``DynamicCache`` layer elsewhere (sliding-window, linear-attention, ...)."""
        cfg = self.kvpop_config
        if cfg.layer_types is None:  # every layer is a full-attention KVpop layer
            return [layer_cls(self.shared, i) for i in range(cfg.num_layers)]
        if model_config is None:
            raise ValueError("This KVpop config covers a model with several layer types: pass the model's config "
                             "(KVpopCache(model.config, kvpop_config=...)) so the other layers get their own cache.")
        layers = default_layers(model_config)
        windows = dict(zip(cfg.layers, self._windows))
        for j, i in enumerate(cfg.layers):
            if windows[i] is None:
                layers[i] = layer_cls(self.shared, j)
            else:
                from .sliding_layer import sliding_kvpop_layer

                layers[i] = sliding_kvpop_layer(layer_cls, self.shared, j, windows[i])
        return layers

    @property
    def kvpop_layer_indices(self) -> list[int]:
        """The decoder layers that hold a KVpop layer (the others keep the model's default cache layer)."""
        cfg = self.kvpop_config
        return list(range(cfg.num_layers)) if cfg.layers is None else list(cfg.layers)

    def __repr__(self) -> str:
        cfg = self.kvpop_config
        return (f"{type(self).__name__}(sinks={cfg.sinks}, window={cfg.window}, topk={cfg.topk}, budget={cfg.budget}, "
                f"scorer={cfg.scorer!r}, layers={len(self.layers)})")

    # -- transformers Cache API ---------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"The model updates layer {layer_idx}, but this KVpopCache has {len(self.layers)} layers: it was "
                "built for another model. Build it from this model's config: KVpopCache(model.config, ...)."
            )
        if layer_idx == self._first_attention_layer() and not torch.compiler.is_compiling():
            self._check_every_layer_updated()
            self._check_reuse(key_states)
        if layer_idx > 0 and getattr(self.layers[layer_idx - 1], "flush_at_next_layer", False):
            self.layers[layer_idx - 1].flush()  # the layer below attended just before: a stock attention raises now
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_every_layer_updated(self) -> None:
        """At a forward's first layer: the previous forward must have updated every layer (eager calls only;
        compiled steps repeat an eager-checked pattern)."""
        kvpop = self.kvpop_layers()
        counts = {layer.updates for layer in kvpop}
        if len(counts) > 1:
            done = sum(layer.updates == kvpop[0].updates for layer in kvpop)
            raise ValueError(
                f"The last forward updated {done} of this KVpopCache's {len(kvpop)} layers: the cache was built "
                "for a deeper model (build it from this model's config), or that forward failed part-way (call "
                "cache.reset() before reusing the cache)."
            )

    def update_conv_state(self, conv_states, layer_idx: int, *args, **kwargs):
        """transformers' conv-state update of a linear-attention layer; at the model's first layer (a linear-attention
        layer updates before any attention layer) the reuse check runs first, as ``update`` does for attention."""
        if layer_idx == 0 and not torch.compiler.is_compiling():
            self._check_reuse(conv_states)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def _check_reuse(self, states) -> None:
        """At a forward's first cache call, before any layer works: a ValueError if the KVpop layers hold another
        batch size or dtype from an earlier generation (the model's other layers would fail with torch's own errors).
        After ``reset()`` (KVpop layers fresh) transformers' own layers that keep their buffers through a reset
        (sliding-window, linear-attention) drop them when the batch size or dtype changed, so they allocate anew."""
        kvpop = self.kvpop_layers()
        for layer in kvpop:
            error = layer.reuse_error(states)
            if error:
                raise ValueError(error)
        if all(getattr(layer, "updates", 0) == 0 for layer in kvpop):
            indices = set(self.kvpop_layer_indices)
            for i, layer in enumerate(self.layers):
                if i not in indices:
                    _drop_other_shape(layer, states.shape[0], states.dtype)

    def kvpop_layers(self) -> list:
        """The KVpop layers (in model order); the cache's other layers are transformers' own."""
        return [self.layers[i] for i in self.kvpop_layer_indices]

    def _first_attention_layer(self) -> int:
        """The first layer that the model updates through ``update`` (linear-attention layers never do)."""
        first = getattr(self, "_first_update_layer", None)
        if first is None:
            from transformers.cache_utils import CacheLayerMixin

            first = self._first_update_layer = next(
                (i for i, layer in enumerate(self.layers) if isinstance(layer, CacheLayerMixin)), 0)
        return first

    # -- settings (shared with the layers, see kvpop_hf/shared.py) ------------------------------
    @property
    def kvpop_config(self) -> KVpopConfig:
        return self.shared.config

    @property
    def scorer(self) -> Scorer:
        return self.shared.scorers.module

    @property
    def log_gamma(self) -> torch.Tensor | None:
        """Per-head decay ``[num_layers, kv_heads]`` (log gamma) or None; may be replaced (e.g. learned values)."""
        return self.shared.log_gamma

    @log_gamma.setter
    def log_gamma(self, value: torch.Tensor | None) -> None:
        self.shared.log_gamma = value

    @property
    def budget(self) -> int:
        return self.kvpop_config.budget

    @property
    def prefill_chunks_exact(self) -> bool:
        """Whether a prompt fed in chunks keeps the same entries as one chunk (and as token by token): true for
        static priorities under the ``kvpop`` attention (the eviction contract); false for attention-scored
        scorers (TOVA, H2O, SnapKV), which compress a prompt chunk at its end."""
        return not self.scorer.dynamic

    def scorer_for(self, device: torch.device) -> Scorer:
        """The scorer on ``device``: the scorer itself on the device it lives on, else a copy made once for
        that device (weights stay float32). Layers spread over several devices (``device_map``) each read
        their own device's copy, so no weights move during generation."""
        return self.shared.scorers.on(device)

    # -- introspection ---------------------------------------------------------------------------
    def stored_positions(self, layer_idx: int) -> torch.Tensor:
        """Real positions held per slot, ``[batch, kv_heads, B]`` (-1: empty)."""
        if layer_idx not in self.kvpop_layer_indices:
            raise ValueError(f"Layer {layer_idx} is not a KVpop layer (it keeps the model's own cache layer, "
                             f"{type(self.layers[layer_idx]).__name__}); KVpop layers: {self.kvpop_layer_indices}.")
        layer = self.layers[layer_idx]
        layer.flush()
        return layer.pos

    def memory_bytes(self) -> int:
        """Bytes of all tensors the cache holds (keys, values, positions, priorities, scorer state)."""
        total = 0
        for layer in self.kvpop_layers():
            if not layer.is_initialized:
                continue
            total += sum(t.numel() * t.element_size() for t in layer._buffers())
        others = [layer for i, layer in enumerate(self.layers) if i not in set(self.kvpop_layer_indices)]
        return total + _state_bytes(others)

    # -- Hub I/O -----------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``kvpop_config.json`` and (for learned scorers / decay) ``kvpop_scorer.safetensors``."""
        if self.tp_kv_heads is not None:
            raise ValueError(f"This KVpopCache holds the scorer of KV heads {list(range(*self.tp_kv_heads))} only (one "
                             "tensor-parallel rank); save the full scorer from a cache built without tensor parallelism.")
        hub.save(save_directory, self.kvpop_config, self.scorer, self.log_gamma)

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str | os.PathLike, model_config=None, *, revision: str | None = None,
                        cache_dir: str | None = None, token: str | None = None, local_files_only: bool = False,
                        backends: Backends | dict | None = None,
                        **overrides) -> "KVpopCache":
        """Load from a local directory or a Hub repo id (through `huggingface_hub`, so the local HF cache
        and ``HF_HUB_OFFLINE=1`` work). `overrides` replace config fields, above all ``topk=...`` (the budget is a
        serving choice); ``sinks``, ``window`` and ``scorer`` are what the checkpoint was trained with, so a value
        other than the checkpoint's is a ValueError (the same value is accepted). ``backends`` as in the
        constructor (never stored in a checkpoint)."""
        backends = Backends.coerce(backends)  # a bad choice fails before any download
        config, state, log_gamma = hub.load(repo_id_or_path, revision=revision, cache_dir=cache_dir, token=token,
                                            local_files_only=local_files_only)
        _check_overrides(config, overrides, repo_id_or_path)
        for key, value in overrides.items():
            setattr(config, key, value)
        config.validate()
        if model_config is not None:  # the checkpoint's shape against the model, before any work
            _check_model_shape(config, model_config_of(model_config), f"Checkpoint {repo_id_or_path}")
        scorer = _build(config)
        hub.load_scorer_state(scorer, state, repo_id_or_path)
        cache = cls(model_config, scorer=scorer, kvpop_config=config, backends=backends)
        if log_gamma is not None:
            cache.log_gamma = slice_heads(log_gamma.float(), cache.tp_kv_heads)
        return cache

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload KVpop scorer") -> str:
        return hub.push(self, repo_id, private=private, token=token, commit_message=commit_message)


def _cap_topk(cfg: KVpopConfig, max_positions: int | None) -> None:
    """``cfg.topk`` set to the long-range slots the longest sequence can fill, with a warning where that is less."""
    slots = slots_for_topk(cfg.sinks, cfg.window, cfg.topk, max_positions)
    if slots < cfg.topk:
        why = (f"leaves at most {max_positions} - sinks {cfg.sinks} - window {cfg.window} = {slots} tokens for the "
               "long-range slots" if slots else f"is no more than sinks {cfg.sinks} + window {cfg.window}: no token "
               "ever reaches the long-range slots")
        warnings.warn(
            f"KVpopCache: topk={cfg.topk} is capped to topk={slots}: the model's max_position_embeddings="
            f"{max_positions} {why}, so the cache allocates and reports topk={slots} (budget "
            f"{cfg.sinks + cfg.window + slots}). Pass topk <= {slots} to build it without this warning.",
            UserWarning, stacklevel=user_stacklevel())
        cfg.topk = slots


TRAINED_FIELDS = ("sinks", "window")  # a checkpoint's scorer (and a model distilled with it) is trained at these


def _check_overrides(config: KVpopConfig, overrides: dict, source) -> None:
    """A ValueError, before anything is built, for an override ``from_pretrained`` must not apply: an unknown field,
    another scorer than the checkpoint's, or other sinks / window than it was trained with."""
    for key in overrides:
        if not hasattr(config, key):
            raise ValueError(f"Unknown override {key!r}; valid fields: {sorted(config.to_dict())}.")
    scorer = overrides.get("scorer", config.scorer)
    if scorer != config.scorer:
        raise ValueError(
            f"A checkpoint's scorer cannot be swapped: {source} holds the scorer {config.scorer!r} (with the weights, "
            f"or the model, trained for it), so from_pretrained(..., scorer={scorer!r}) is refused. For a "
            f"{scorer!r} cache without the checkpoint build it directly: KVpopCache(model.config, scorer={scorer!r}, "
            f"sinks=..., window=..., topk=...); to serve the checkpoint, omit scorer=."
        )
    changed = [(key, getattr(config, key), overrides[key]) for key in TRAINED_FIELDS
               if key in overrides and overrides[key] != getattr(config, key)]
    if changed:
        trained = ", ".join(f"{key}={old}" for key, old, _ in changed)
        given = ", ".join(f"{key}={new!r}" for key, _, new in changed)
        omit = " and ".join(f"{key}=" for key, _, _ in changed)
        raise ValueError(
            f"Checkpoint {source} was trained with {trained} (its kvpop_config.json), but from_pretrained got "
            f"{given}: a learned scorer is served with the sinks and window it was trained with, and the budget is "
            f"changed through topk. Omit {omit} to use the trained value{'s' if len(changed) > 1 else ''}."
        )


def _check_model_shape(config: KVpopConfig, model_config, what: str) -> dict:
    """The model's ``{num_layers, num_kv_heads, head_dim, layers, layer_types, windows}``; a ValueError if ``config``
    names other values (another shape or another layer pattern). ``config`` may be another cache's config with
    the same shape fields (a ``DMSConfig``): without KVpop's layer fields it is a full-attention checkpoint."""
    sliding = getattr(config, "sliding_layers", "window")
    layers, layer_types = getattr(config, "layers", None), getattr(config, "layer_types", None)
    plan = layer_plan(model_config, sliding)
    if layers is None and config.num_layers is not None and not all(plan.kvpop):
        raise ValueError(f"{what} was made for a model whose {config.num_layers} layers are all full attention, but "
                         f"this model has layer types {sorted(set(plan.types))} (KVpop layers {plan.kvpop_layers}). "
                         "Use a KVpop checkpoint trained for this model (or a heuristic scorer).")
    for field, stored, value in (("layers", layers, plan.kvpop_layers), ("layer_types", layer_types, list(plan.types))):
        if stored is not None and list(stored) != value:
            raise ValueError(f"{what} covers KVpop layers {layers} of a model with layer types "
                             f"{layer_types} (sliding_layers={sliding!r}), but this model's "
                             f"{field} are {value} (KVpop layers {plan.kvpop_layers}). Use a KVpop checkpoint "
                             "trained for this model's layer pattern (or a heuristic scorer).")
    shape = dict(zip(("num_layers", "num_kv_heads", "head_dim"), model_shape(model_config, sliding)))
    for field, value in shape.items():
        stored = getattr(config, field)
        if stored is not None and stored != value:
            raise ValueError(f"{what} was made for {field}={stored}, but the model has {field}={value}. Use a KVpop "
                             "checkpoint trained for this model (or a heuristic scorer).")
    shape.update(config_layer_fields(plan))
    shape["windows"] = [plan.windows[i] for i in plan.kvpop_layers]
    return shape


def _drop_other_shape(layer, batch: int, dtype: torch.dtype) -> None:
    """Unallocate the buffers of one of transformers' own cache layers that hold another batch size or dtype (its
    ``reset()`` zeroes them in place), so that its next update allocates them for ``batch`` and ``dtype``."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticLayer

    if isinstance(layer, StaticLayer) and layer.is_initialized and (
            layer.keys.shape[0] != batch or layer.keys.dtype != dtype):
        layer.keys = layer.values = None
        layer.is_initialized = False
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for i in range(layer.number_of_states):
            conv, recurrent = layer.conv_states[i], layer.recurrent_states[i]  # a recurrent state may keep float32
            if (isinstance(conv, torch.Tensor) and (conv.shape[0] != batch or conv.dtype != dtype)) or (
                    isinstance(recurrent, torch.Tensor) and recurrent.shape[0] != batch):
                layer.conv_states[i] = layer.recurrent_states[i] = None
                layer.is_conv_states_initialized[i] = layer.is_recurrent_states_initialized[i] = False


def _state_bytes(layers) -> int:
    """Bytes of the tensors of transformers' own cache layers (keys/values, conv and recurrent states)."""
    total = 0
    for layer in layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for name in ("conv_states", "recurrent_states"):
            tensors += list((getattr(layer, name, None) or {}).values())
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def kv_tensor_bytes(cache: Cache) -> int:
    """Bytes of the key/value tensors held by any `transformers` cache (e.g. a DynamicCache), for
    comparisons with :meth:`KVpopCache.memory_bytes`."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _build(cfg: KVpopConfig) -> Scorer:
    try:
        return build_scorer(cfg.scorer, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, **cfg.scorer_kwargs)
    except TypeError as err:
        raise ValueError(f"Bad `scorer_kwargs` {cfg.scorer_kwargs} for scorer {cfg.scorer!r}: {err}") from err
