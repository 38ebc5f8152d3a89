"""KVpopCache: a `transformers.Cache` with a fixed per-head budget ``B = s + w + k`` (KVpop, arXiv:2607.05061)."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
from transformers.cache_utils import Cache

from . import hub
from .backends import Backends
from .config import KVpopConfig, model_shape
from .baselines.attention_policies.layer import DynamicScoreLayer
from .layer import KVpopLayer
from .scorers import Scorer, build_scorer, scorer_name


class KVpopCache(Cache):
    """Fixed-budget KV cache: per layer and KV head, ``sinks`` first tokens, the ``window`` most recent
    tokens and ``topk`` long-range tokens won by a scorer's static priority.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvpop")
        cache = KVpopCache(model.config, sinks=4, window=256, topk=1788, scorer="knorm")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4096)

    For a prompt too long for one forward, fill the cache in chunks first and let ``generate`` continue
    (its decode steps stay compiled on CUDA): ``kvpop_hf.prefill_in_chunks(model, cache, ids, 16384)``.

    With ``attn_implementation="kvpop"`` every query of a multi-token chunk sees exactly its own
    fixed-budget set per head; with a stock implementation (sdpa, eager) single-token decoding is
    exact but a prompt chunk sees all of its own tokens plus the stored ones (a warning says so).

    Args:
        model_config: the model's `PretrainedConfig` (gives layers, KV heads, head size) or None
            when a `kvpop_config` with the model shape is given.
        sinks, window, topk: the budget. scorer: a name from `kvpop_hf.scorers.SCORERS` or a `Scorer`;
            "tova", "h2o" and "snapkv" take their scores from the attention (docs/design.md §7) and need
            ``attn_implementation="kvpop"``.
        log_gamma, decay_step: optional recency decay shared by all heads.
        scorer_kwargs: keyword arguments of the scorer (e.g. ``{"hidden": 64}`` for "mlp").
        backends: which implementation runs each fast path, a :class:`~kvpop_hf.backends.Backends` or a dict of
            its fields (docs/backends.md); unset fields come from ``KVPOP_*`` environment variables, else the
            device's default. A runtime choice: not part of the saved config.
    """

    def __init__(self, model_config=None, sinks: int = 4, window: int = 256, topk: int = 1788,
                 scorer: str | Scorer = "knorm", log_gamma: float | None = None, decay_step: int = 64,
                 scorer_kwargs: dict | None = None, kvpop_config: KVpopConfig | None = None,
                 backends: Backends | dict | None = None):
        self.backends = Backends.coerce(backends)
        if kvpop_config is None:
            name = scorer if isinstance(scorer, str) else scorer_name(scorer)
            if isinstance(scorer, Scorer) and scorer_kwargs is None:
                scorer_kwargs = scorer.config_dict()
            kvpop_config = KVpopConfig(sinks=sinks, window=window, topk=topk, scorer=name,
                                       scorer_kwargs=dict(scorer_kwargs or {}), log_gamma=log_gamma,
                                       decay_step=decay_step)
        else:
            kvpop_config.validate()
        if model_config is not None:
            for field, value in _check_model_shape(kvpop_config, model_config, "This KVpop checkpoint").items():
                setattr(kvpop_config, field, value)
            kvpop_config.base_model = kvpop_config.base_model or getattr(model_config, "_name_or_path", None) or None
        if kvpop_config.num_layers is None:
            raise ValueError("KVpopCache needs the model shape: pass the model's config as first argument.")
        self.kvpop_config = kvpop_config
        cfg = kvpop_config
        if isinstance(scorer, Scorer):
            self.scorer = scorer
        else:
            self.scorer = _build(cfg)
        if (self.scorer.num_layers, self.scorer.num_kv_heads, self.scorer.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"Scorer shape (layers={self.scorer.num_layers}, kv_heads={self.scorer.num_kv_heads}, "
                f"head_dim={self.scorer.head_dim}) does not match the model "
                f"({cfg.num_layers}, {cfg.num_kv_heads}, {cfg.head_dim})."
            )
        self.scorer.requires_grad_(False)
        self.scorer.eval()
        # optional learned per-head decay [num_layers, kv_heads] (log gamma), else the config's scalar
        self.log_gamma: torch.Tensor | None = None
        if cfg.log_gamma is not None:
            self.log_gamma = torch.full((cfg.num_layers, cfg.num_kv_heads), float(cfg.log_gamma))
        self._warned_stock = False
        # copies for layers on other devices than the scorer/decay (device_map): device -> copy
        self._scorer_copies: dict = {}
        self._log_gamma_copies: dict = {}
        # attention-based policies (TOVA, H2O, SnapKV) re-score entries every step: their own storage class
        layer_cls = DynamicScoreLayer if getattr(self.scorer, "dynamic", False) else KVpopLayer
        if layer_cls is DynamicScoreLayer and cfg.log_gamma is not None:
            raise ValueError(f"`log_gamma` (recency decay of static priorities) does not apply to the attention-based "
                             f"policy {cfg.scorer!r}, whose scores change every step; leave it None.")
        super().__init__(layers=[layer_cls(self, i) for i in range(cfg.num_layers)])

    # -- transformers Cache API ---------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"The model updates layer {layer_idx}, but this KVpopCache has {len(self.layers)} layers: it was "
                "built for another model. Build it from this model's config: KVpopCache(model.config, ...)."
            )
        if layer_idx == 0 and not torch.compiler.is_compiling():
            self._check_every_layer_updated()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_every_layer_updated(self) -> None:
        """At a forward's first layer: the previous forward must have updated every layer (eager calls only;
        compiled steps repeat an eager-checked pattern)."""
        counts = {layer.updates for layer in self.layers}
        if len(counts) > 1:
            done = sum(layer.updates == self.layers[0].updates for layer in self.layers)
            raise ValueError(
                f"The last forward updated {done} of this KVpopCache's {len(self.layers)} layers: the cache was built "
                "for a deeper model (build it from this model's config), or that forward failed part-way (call "
                "cache.reset() before reusing the cache)."
            )

    # -- helpers used by the layers ----------------------------------------------------------
    @property
    def budget(self) -> int:
        return self.kvpop_config.budget

    def check_shape(self, layer_idx: int, kv_heads: int, head_dim: int) -> None:
        cfg = self.kvpop_config
        if (kv_heads, head_dim) != (cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"Layer {layer_idx} has {kv_heads} KV heads of size {head_dim}, but this KVpopCache was built for "
                f"{cfg.num_kv_heads} heads of size {cfg.head_dim}. Build the cache from this model's config."
            )

    def scorer_for(self, device: torch.device) -> Scorer:
        """The scorer on ``device``: the scorer itself on the device it lives on, else a copy made once for
        that device (weights stay float32). Layers spread over several devices (``device_map``) each read
        their own device's copy, so no weights move during generation."""
        device = _canonical(device)
        first = next(iter(self.scorer.parameters()), None)
        if first is None or first.device == device:
            return self.scorer
        replica = self._scorer_copies.get(device)
        if replica is None:
            replica = copy.deepcopy(self.scorer).to(device)
            self._scorer_copies[device] = replica
        return replica

    def log_gamma_for(self, layer_idx: int, device) -> torch.Tensor | None:
        """This layer's per-head decay on ``device`` (copied once per device), or None."""
        if self.log_gamma is None:
            return None
        device = _canonical(device)
        if self.log_gamma.device == device:
            return self.log_gamma[layer_idx]
        source, copy_on_device = self._log_gamma_copies.get(device, (None, None))
        if source is not self.log_gamma:  # first use on this device, or `log_gamma` was replaced since
            copy_on_device = self.log_gamma.to(device)
            self._log_gamma_copies[device] = (self.log_gamma, copy_on_device)
        return copy_on_device[layer_idx]

    def warn_stock_attention(self, padding_unseen: bool = False) -> None:
        """Warn once that a chunk ran under a stock attention; ``padding_unseen``: a batch of several rows whose
        position ids transformers did not pass to ``update``, so left padding could not be checked."""
        if not self._warned_stock:
            self._warned_stock = True
            padding = (" This transformers version does not pass the position ids to the cache, so a left-padded "
                       "batch cannot be recognised: its padded rows would come out wrong without an error; "
                       "attn_implementation='kvpop' handles left padding exactly." if padding_unseen else "")
            warnings.warn(
                "KVpopCache: a multi-token chunk is attended with a stock attention implementation, so its "
                "queries see every stored entry plus all tokens of the chunk (more than the budget). Load the "
                "model with attn_implementation='kvpop' for exact per-head eviction inside chunks; single-token "
                "decoding is exact either way." + padding,
                stacklevel=user_stacklevel(),
            )

    # -- introspection ---------------------------------------------------------------------------
    def stored_positions(self, layer_idx: int) -> torch.Tensor:
        """Real positions held per slot, ``[batch, kv_heads, B]`` (-1: empty)."""
        layer = self.layers[layer_idx]
        layer.flush()
        return layer.pos

    def memory_bytes(self) -> int:
        """Bytes of all tensors the cache holds (keys, values, positions, priorities, scorer state)."""
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            total += sum(t.numel() * t.element_size() for t in layer._buffers())
        return total

    # -- Hub I/O -----------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``kvpop_config.json`` and (for learned scorers / decay) ``kvpop_scorer.safetensors``."""
        hub.save(save_directory, self.kvpop_config, self.scorer, self.log_gamma)

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str | os.PathLike, model_config=None, *, revision: str | None = None,
                        cache_dir: str | None = None, token: str | None = None, local_files_only: bool = False,
                        backends: Backends | dict | None = None,
                        **overrides) -> "KVpopCache":
        """Load from a local directory or a Hub repo id (through `huggingface_hub`, so the local HF cache
        and ``HF_HUB_OFFLINE=1`` work). `overrides` replace budget fields (e.g. ``topk=...``); ``backends`` as in
        the constructor (never stored in a checkpoint)."""
        backends = Backends.coerce(backends)  # a bad choice fails before any download
        config, state, log_gamma = hub.load(repo_id_or_path, revision=revision, cache_dir=cache_dir, token=token,
                                            local_files_only=local_files_only)
        for key, value in overrides.items():
            if not hasattr(config, key):
                raise ValueError(f"Unknown override {key!r}; valid fields: {sorted(config.to_dict())}.")
            setattr(config, key, value)
        config.validate()
        if model_config is not None:  # the checkpoint's shape against the model, before any work
            _check_model_shape(config, model_config, f"Checkpoint {repo_id_or_path}")
        scorer = _build(config)
        hub.load_scorer_state(scorer, state, repo_id_or_path)
        cache = cls(model_config, scorer=scorer, kvpop_config=config, backends=backends)
        if log_gamma is not None:
            cache.log_gamma = log_gamma.float()
        return cache

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload KVpop scorer") -> str:
        return hub.push(self, repo_id, private=private, token=token, commit_message=commit_message)


def _check_model_shape(config: KVpopConfig, model_config, what: str) -> dict:
    """The model's ``{num_layers, num_kv_heads, head_dim}``; a ValueError if ``config`` names other values."""
    shape = dict(zip(("num_layers", "num_kv_heads", "head_dim"), model_shape(model_config)))
    for field, value in shape.items():
        stored = getattr(config, field)
        if stored is not None and stored != value:
            raise ValueError(f"{what} was made for {field}={stored}, but the model has {field}={value}. Use a KVpop "
                             "checkpoint trained for this model (or a heuristic scorer).")
    return shape


def _canonical(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside kvpop_hf, transformers and
    torch (a warning raised inside a model's forward would otherwise point into library code)."""
    import transformers

    internal = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                     for m in (torch, transformers, sys.modules[__package__]))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


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
