"""Which implementation runs each fast path: one record, :class:`Backends`, resolved once per layer.

Every fast path has a plain torch reference beside it (docs/backends.md lists them). A choice is a
field of :class:`Backends`; ``"auto"`` picks the fast path on CUDA and the torch reference elsewhere
(a few choices are the same on every device, see :data:`CHOICES`). A cache takes the record as
``KVpopCache(..., backends=Backends(decode_eviction="torch"))`` or as a dict of the same fields; each
layer resolves it for its own device when it allocates its buffers (:meth:`Backends.resolve`), so
decode steps and prompt chunks never read the environment.

A field left ``None`` takes its default from the environment variable ``KVPOP_<FIELD>`` (e.g.
``KVPOP_DECODE_EVICTION=torch``), else ``"auto"``; an explicit value wins over the environment. The
environment is read here only, at :meth:`Backends.resolve`.

The record is a runtime choice, not a property of a trained scorer: it is not saved with the
:class:`~kvpop_hf.config.KVpopConfig` (``save_pretrained`` writes no backend; ``from_pretrained`` takes
``backends=`` like the constructor).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .kernels import MISSING_TRITON, triton_available

__all__ = ["Backends", "CHOICES"]

# field -> (allowed values without "auto", what "auto" is on CUDA, what "auto" is elsewhere)
CHOICES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "decode_eviction": (("torch", "triton"), "triton", "torch"),
    "decode_attention": (("torch", "triton"), "triton", "torch"),
    "mlstm_step": (("torch", "triton"), "triton", "torch"),
    "chunk_attention": (("dense", "flex"), "flex", "dense"),
    "flex_block_mask": (("interval", "tiled", "create"), "interval", "interval"),
    "chunk_cutoff": (("blocked", "torch", "wavelet", "triton"), "blocked", "blocked"),
    # "auto" is torch.compile's own default (dynamic=None: static shapes first, dynamic after a recompile)
    "flex_dynamic": (("true", "false"), "auto", "auto"),
}

# choices that launch a Triton kernel (off CUDA only through the Triton interpreter)
_TRITON = {(name, "triton") for name in CHOICES}


def env_var(name: str) -> str:
    """The environment variable that gives ``name``'s default: ``KVPOP_<NAME>``."""
    return "KVPOP_" + name.upper()


def _allowed(name: str) -> tuple[str, ...]:
    return ("auto",) + CHOICES[name][0]


@dataclass(frozen=True)
class Backends:
    """One choice per fast path (``None``: the environment's ``KVPOP_<FIELD>``, else ``"auto"``).

    * ``decode_eviction``: a decode step's eviction and insertion (:mod:`kvpop_hf.decode_eviction`), ``torch|triton``;
    * ``decode_attention``: a decode step's attention over the ``B`` slots (:mod:`kvpop_hf.decode_attention`),
      ``torch|triton``;
    * ``mlstm_step``: the mLSTM scorer's part of a decode step (:mod:`kvpop_hf.scorers.mlstm_decode_triton`),
      ``torch|triton``;
    * ``chunk_attention``: a prompt chunk's attention (:mod:`kvpop_hf.chunk_attention`), ``dense`` (an SDPA mask
      ``[L x C]`` per head) or ``flex`` (FlexAttention, compiled on CUDA);
    * ``flex_block_mask``: the block mask of ``flex``: ``interval`` (candidates reordered, kvpop_hf/interval_mask.py),
      ``tiled`` (plan order, analytic block flags) or ``create`` (torch's ``create_block_mask``);
    * ``chunk_cutoff``: the per-query top-k cutoff of ``flex`` (:func:`kvpop_hf.flex_mask.chunk_cutoff`):
      ``blocked`` (parallel over query blocks) or a running top-k sweep, ``torch|wavelet|triton``;
    * ``flex_dynamic``: ``dynamic`` of the compiled inference flex on CUDA: ``auto`` (torch's default), ``true``,
      ``false``.
    """

    decode_eviction: str | None = None
    decode_attention: str | None = None
    mlstm_step: str | None = None
    chunk_attention: str | None = None
    flex_block_mask: str | None = None
    chunk_cutoff: str | None = None
    flex_dynamic: str | None = None

    def __post_init__(self) -> None:
        for name in CHOICES:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _checked(name, value, f"Backends({name}=...)"))

    @classmethod
    def coerce(cls, value: "Backends | dict | None") -> "Backends":
        """A :class:`Backends` from a record, a dict of its fields or None (all from the environment)."""
        if value is None:
            value = cls()
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(CHOICES))
            if unknown:
                raise ValueError(f"Unknown backends {unknown}; the choices are {sorted(CHOICES)} (docs/backends.md).")
            value = cls(**value)
        if isinstance(value, cls):
            value._check_environment()
            return value
        raise ValueError(f"`backends` must be a kvpop_hf.Backends, a dict of its fields or None, got "
                         f"{type(value).__name__}.")

    def _check_environment(self) -> None:
        """A bad ``KVPOP_<FIELD>`` value of an unset field is refused now, not at the first forward."""
        for name in CHOICES:
            raw = os.environ.get(env_var(name))
            if getattr(self, name) is None and raw is not None:
                _checked(name, raw, env_var(name))

    def resolve(self, device: torch.device | str) -> "Backends":
        """Every field concrete for tensors on ``device``: the explicit value, else ``KVPOP_<FIELD>``, else
        ``"auto"``, and ``"auto"`` replaced by the device's default. A Triton choice needs triton (ImportError
        naming the fix), and off CUDA the Triton interpreter (``TRITON_INTERPRET=1``): refused here, before any
        work. ``"auto"`` off CUDA never needs triton."""
        chosen = {}
        for name in CHOICES:
            value = getattr(self, name)
            if value is None:
                raw = os.environ.get(env_var(name))
                value = "auto" if raw is None else _checked(name, raw, env_var(name))
            chosen[name] = resolve_choice(name, value, device)
        return Backends(**chosen)

    @classmethod
    def defaults(cls, device: torch.device | str) -> "Backends":
        """The device's defaults (every field ``"auto"``, resolved; no environment)."""
        return cls(**{name: "auto" for name in CHOICES}).resolve(device)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve_choice(name: str, value: str, device: torch.device | str) -> str:
    """One field's concrete choice for tensors on ``device`` (``"auto"``: the device's default); a Triton choice
    without Triton, or off CUDA without the Triton interpreter, is refused naming the fix."""
    value = _checked(name, value, f"Backends({name}=...)")
    cuda = torch.device(device).type == "cuda"
    if value == "auto":
        value = CHOICES[name][1] if cuda else CHOICES[name][2]
    if (name, value) in _TRITON:
        _check_triton(name, cuda)
    return value


def _checked(name: str, value, where: str) -> str:
    allowed = _allowed(name)
    text = value.lower() if isinstance(value, str) else value
    if text not in allowed:
        raise ValueError(f"{where} must be one of {allowed}, got {value!r} (docs/backends.md).")
    return text


def _check_triton(name: str, cuda: bool) -> None:
    if not triton_available():
        other = "blocked" if name == "chunk_cutoff" else "torch"
        raise ImportError(MISSING_TRITON.format(what=f"The {name} backend 'triton'",
                                                hint=f"; or choose Backends({name}='{other}') "
                                                     f"({env_var(name)}={other})"))
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"The {name} backend 'triton' runs on CUDA; on another device only through the Triton "
                           f"interpreter (TRITON_INTERPRET=1 set before triton is imported). Choose "
                           f"Backends({name}='auto') or 'torch' there.")
