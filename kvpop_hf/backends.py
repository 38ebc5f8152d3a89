"""Which implementation runs each fast path, in inference and in training: one record, :class:`Backends`.

Every fast path has a plain torch reference beside it (docs/backends.md lists them, with the test that compares
the two). A choice is a field of :class:`Backends`; ``"auto"`` picks the fast path on CUDA and the torch reference
elsewhere (:data:`CHOICES`). One record serves both sides, because a user who picks the kernels of a machine picks
them for serving and training alike: the inference fields (:data:`INFERENCE_FIELDS`) are what a
:class:`~kvpop_hf.cache.KVpopCache` layer runs, the training fields (:data:`TRAINING_FIELDS`) what
:class:`~kvpop_hf.trainer.KVpopTrainer` runs. Each consumer resolves the fields it uses, once, with
:meth:`Backends.resolve`: a cache layer when it allocates its buffers, the trainer when it is built (for
``args.device``). Decode steps, prompt chunks and training steps never read the environment.

A public field left ``None`` takes its default from the environment variable ``KVPOP_<FIELD>`` (e.g.
``KVPOP_DECODE_EVICTION=torch``), else ``"auto"``; an explicit value wins over the environment. The environment
is read here only, at :meth:`Backends.resolve` (and checked at :meth:`Backends.coerce`).

Fields whose name starts with ``_`` (:data:`VARIANTS`) are private: implementation variants that the tests
compare with the reference (and a benchmark may time), with one default on every device, no environment
variable, and no place in the docs' table.

The record is a runtime choice, not a property of a trained scorer: it is not saved with the
:class:`~kvpop_hf.config.KVpopConfig` (``save_pretrained`` writes no backend; ``from_pretrained`` takes
``backends=`` like the constructor).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .ops.kernels import MISSING_TRITON, triton_available

__all__ = ["Backends", "CHOICES", "INFERENCE_FIELDS", "TRAINING_FIELDS", "VARIANTS"]

# public field -> (allowed values without "auto", what "auto" is on CUDA, what "auto" is elsewhere)
CHOICES: dict[str, tuple[tuple[str, ...], str, str]] = {
    # inference (a KVpopCache layer)
    "decode_eviction": (("torch", "triton"), "triton", "torch"),
    "decode_attention": (("torch", "triton"), "triton", "torch"),
    "mlstm_step": (("torch", "triton"), "triton", "torch"),
    "chunk_attention": (("dense", "flex"), "flex", "dense"),
    # training (KVpopTrainer, student_forward)
    "running_topk": (("torch", "wavelet", "triton"), "wavelet", "torch"),
    "train_attention": (("dense", "flex"), "flex", "dense"),
    "target_pass": (("chunked", "flex"), "flex", "chunked"),
}

# private field -> (allowed values, the value on every device)
VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    # the block mask of chunk_attention="flex": interval layout | plan order with analytic flags | create_block_mask
    "_flex_block_mask": (("interval", "tiled", "create"), "interval"),
    # the per-query cutoff of chunk_attention="flex": parallel over query blocks | a running top-k sweep
    "_chunk_cutoff": (("blocked", "torch", "wavelet", "triton"), "blocked"),
    # the key order of train_attention="flex": interval layout | position order
    "_train_block_mask": (("interval", "analytic"), "interval"),
}

INFERENCE_FIELDS = ("decode_eviction", "decode_attention", "mlstm_step", "chunk_attention", "_flex_block_mask",
                    "_chunk_cutoff")
TRAINING_FIELDS = ("running_topk", "train_attention", "target_pass", "_train_block_mask")
_FIELDS = INFERENCE_FIELDS + TRAINING_FIELDS


def env_var(name: str) -> str:
    """The environment variable that gives public field ``name``'s default: ``KVPOP_<NAME>``."""
    return "KVPOP_" + name.upper()


@dataclass(frozen=True)
class Backends:
    """One choice per fast path (``None``: the environment's ``KVPOP_<FIELD>``, else ``"auto"``).

    Inference (:data:`INFERENCE_FIELDS`):

    * ``decode_eviction``: a decode step's eviction and insertion (:mod:`kvpop_hf.ops.decode_eviction`), ``torch|triton``;
    * ``decode_attention``: a decode step's attention over the ``B`` slots (:mod:`kvpop_hf.ops.decode_attention`),
      ``torch|triton``;
    * ``mlstm_step``: the mLSTM scorer's part of a decode step (:mod:`kvpop_hf.ops.mlstm_decode`),
      ``torch|triton``;
    * ``chunk_attention``: a prompt chunk's attention (:mod:`kvpop_hf.ops.chunk_attention`), ``dense`` (an SDPA mask
      ``[L x C]`` per head) or ``flex`` (FlexAttention, compiled on CUDA).

    Training (:data:`TRAINING_FIELDS`):

    * ``running_topk``: the running top-k over whole sequences ``[b, h, S]`` (:mod:`kvpop_hf.ops.running_topk`),
      ``torch|wavelet|triton``;
    * ``train_attention``: the student's fixed-budget sparse attention (:mod:`kvpop_hf.ops.sparse_attention`),
      ``dense`` (the masked ``[S x S]`` reference) or ``flex``;
    * ``target_pass``: the transposed future-attention target pass (:mod:`kvpop_hf.ops.targets`),
      ``chunked`` or ``flex`` (``target_reduce`` other than ``mean`` needs ``chunked``).

    Private variants (:data:`VARIANTS`, leading ``_``): ``_flex_block_mask``, ``_chunk_cutoff``,
    ``_train_block_mask``.
    """

    decode_eviction: str | None = None
    decode_attention: str | None = None
    mlstm_step: str | None = None
    chunk_attention: str | None = None
    running_topk: str | None = None
    train_attention: str | None = None
    target_pass: str | None = None
    _flex_block_mask: str | None = None
    _chunk_cutoff: str | None = None
    _train_block_mask: str | None = None

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _checked(name, value, f"Backends({name}=...)"))

    @classmethod
    def coerce(cls, value: "Backends | dict | None") -> "Backends":
        """A :class:`Backends` from a record, a dict of its fields or None (all from the environment); a bad
        ``KVPOP_<FIELD>`` value of an unset field is refused now, not at the first forward."""
        if value is None:
            value = cls()
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(_FIELDS))
            if unknown:
                raise ValueError(f"Unknown backends {unknown}; the choices are {sorted(CHOICES)} (docs/backends.md).")
            value = cls(**value)
        if not isinstance(value, cls):
            raise ValueError(f"`backends` must be a kvpop_hf.Backends, a dict of its fields or None, got "
                             f"{type(value).__name__}.")
        for name in CHOICES:
            value.requested(name)
        return value

    def requested(self, name: str) -> str:
        """Field ``name`` as asked for, before the device is known: the explicit value, else (public fields)
        ``KVPOP_<FIELD>``, else ``"auto"`` (public) or the variant's default (private)."""
        value = getattr(self, name)
        if value is not None:
            return value
        if name in VARIANTS:
            return VARIANTS[name][1]
        raw = os.environ.get(env_var(name))
        return "auto" if raw is None else _checked(name, raw, env_var(name))

    def resolve(self, device: torch.device | str, fields: tuple[str, ...] | None = None,
                target_reduce: str = "mean") -> "Backends":
        """``fields`` (default: all) concrete for tensors on ``device``, the others as given: the requested value
        (:meth:`requested`), ``"auto"`` replaced by the device's default. A Triton choice needs triton (ImportError
        naming the fix), and off CUDA the Triton interpreter (``TRITON_INTERPRET=1``): refused here, before any
        work; ``"auto"`` off CUDA never needs triton. ``target_reduce`` (the trainer's): other than ``"mean"``,
        ``target_pass`` ``"auto"`` is ``"chunked"`` and ``"flex"`` is refused."""
        fields = _FIELDS if fields is None else fields
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise ValueError(f"Unknown backends {unknown}; the choices are {sorted(CHOICES)} (docs/backends.md).")
        chosen = {}
        for name in fields:
            requested = self.requested(name)
            if name == "target_pass":
                requested = _target_pass(requested, target_reduce)
            chosen[name] = resolve_choice(name, requested, device)
        return dataclasses.replace(self, **chosen)

    def check_target_reduce(self, target_reduce: str) -> None:
        """Refuse now what :meth:`resolve` would refuse on every device: ``target_pass="flex"`` (explicit or from
        ``KVPOP_TARGET_PASS``) with a ``target_reduce`` other than ``"mean"``."""
        _target_pass(self.requested("target_pass"), target_reduce)

    @classmethod
    def defaults(cls, device: torch.device | str, fields: tuple[str, ...] | None = None) -> "Backends":
        """The device's defaults of ``fields`` (default: all; every field ``"auto"``, resolved; no environment)."""
        names = _FIELDS if fields is None else fields
        return cls(**{name: "auto" for name in names if name in CHOICES}).resolve(device, names)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def given(self) -> dict:
        """The fields set explicitly (a JSON-serialisable dict, ``Backends(**given())`` gives the record back)."""
        return {name: value for name, value in self.to_dict().items() if value is not None}


def resolve_choice(name: str, value: str, device: torch.device | str) -> str:
    """One field's concrete choice for tensors on ``device`` (``"auto"``: the device's default); a Triton choice
    without Triton, or off CUDA without the Triton interpreter, is refused naming the fix."""
    value = _checked(name, value, f"Backends({name}=...)")
    cuda = torch.device(device).type == "cuda"
    if value == "auto":
        value = CHOICES[name][1] if cuda else CHOICES[name][2]
    if value == "triton":
        _check_triton(name, cuda)
    return value


def _target_pass(requested: str, target_reduce: str) -> str:
    if target_reduce == "mean":
        return requested
    if requested == "flex":
        raise ValueError(f"target_reduce={target_reduce!r} runs on the chunked target pass; use "
                         "Backends(target_pass='auto') or 'chunked' (FlexAttention's transposed pass yields a "
                         "log-sum-exp, not a max or a power mean).")
    return "chunked"


def _allowed(name: str) -> tuple[str, ...]:
    return VARIANTS[name][0] if name in VARIANTS else ("auto",) + CHOICES[name][0]


def _checked(name: str, value, where: str) -> str:
    allowed = _allowed(name)
    text = value.lower() if isinstance(value, str) else value
    if text not in allowed:
        raise ValueError(f"{where} must be one of {allowed}, got {value!r} (docs/backends.md).")
    return text


def _check_triton(name: str, cuda: bool) -> None:
    other = VARIANTS[name][1] if name in VARIANTS else CHOICES[name][2]
    hint = f"Backends({name}='{other}')" + ("" if name in VARIANTS else f" ({env_var(name)}={other})")
    if not triton_available():
        raise ImportError(MISSING_TRITON.format(what=f"The {name} backend 'triton'", hint=f"; or choose {hint}"))
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"The {name} backend 'triton' runs on CUDA; on another device only through the Triton "
                           f"interpreter (TRITON_INTERPRET=1 set before triton is imported). Choose {hint} there.")
