"""How a cache layer tells the ``kvpop`` attention what a call needs: one object on the keys it returns.

A cache layer's ``update`` runs right before the layer's attention and returns the keys/values to attend
to. Where the attention needs more than those (which candidates each query may see, where to hand scores
back), the layer attaches one :class:`Handoff` to the returned keys (:func:`attach`); the attention finds
it with :func:`handoff_of` and calls its :meth:`~Handoff.attend`. The hand-off belongs to the returned
tensor: no module state, so two caches in two threads or a nested model cannot see each other's calls.
Its kinds:

* ``"chunk"``: a KVpopCache prompt chunk (:class:`kvpop_hf.layer.PendingChunk`), committed with the
  forward's padding, then attended to the exact per-head plan ``R(q)`` (:mod:`kvpop_hf.ops.chunk_attention`);
* ``"scores"``: a step of an attention-based policy (TOVA, H2O, SnapKV), which hands the attention
  probabilities back to the layer (:mod:`kvpop_hf.baselines.attention_policies.layer`);
* ``"dms"``: a DMS step, a different set of live tokens per KV head (:mod:`kvpop_hf.baselines.dms.handoff`).

The decode fast path of a KVpopCache is separate (:class:`DecodeSlots`): a fixed-shape step that
``torch.compile`` traces, over all ``B`` slots of the layer's buffers, of which ``slot < seen[row]`` are
visible. Its record sits on the layer's key buffer once, when the buffers are allocated.

Keys with neither come from another cache (or none: training) and get plain causal attention.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

HANDOFF_ATTRIBUTE = "kvpop_handoff"
DECODE_ATTRIBUTE = "kvpop_decode"

__all__ = ["DecodeSlots", "Handoff", "LayerHandoff", "attach", "handoff_of"]


class Handoff:
    """What one attention call needs beyond its keys and values. ``kind`` names it (``"chunk"``, ``"scores"``,
    ``"dms"``); :meth:`attend` runs the call: query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]`` (the
    tensors the layer returned), valid ``[b, L]`` bool (True: a real token) or None (no padding) ->
    ``[b, L, Hq, dv]``. It may update the layer (a hand-off runs once)."""

    kind: str = ""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None,
               scaling: float | None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")


class LayerHandoff(Handoff):
    """A hand-off that holds its layer weakly (the layer holds the hand-off as ``layer.pending``) and runs once."""

    cache_name = "cache"

    def __init__(self, layer):
        self._layer = weakref.ref(layer)
        self.done = False

    def layer(self):
        layer = self._layer()
        if layer is None:
            raise RuntimeError(f"The {self.cache_name} of this attention call was deleted before its attention ran.")
        if self.done or layer.pending is not self:
            raise RuntimeError(f"A {self.cache_name} attention hand-off was used twice or out of order: each "
                               "forward's attention must run once, before the next forward updates the same cache.")
        return layer

    def finished(self) -> None:
        """Mark this hand-off done and release the layer's reference to it."""
        layer = self.layer()
        self.done, layer.pending = True, None


def attach(tensor: torch.Tensor, handoff: Handoff | None) -> torch.Tensor:
    """Attach ``handoff`` (or clear it with None) to the keys a layer returns; returns ``tensor``."""
    setattr(tensor, HANDOFF_ATTRIBUTE, handoff)
    return tensor


def handoff_of(tensor: torch.Tensor) -> Handoff | None:
    """The hand-off attached to ``tensor``, or None."""
    return getattr(tensor, HANDOFF_ATTRIBUTE, None)


@dataclass(frozen=True)
class DecodeSlots:
    """A KVpopCache decode step: all ``B`` slots, ``slot < seen[row]`` visible; ``attention`` is the layer's
    decode attention (the backend chosen once, :mod:`kvpop_hf.ops.decode_attention`)."""

    seen: torch.Tensor
    attention: Callable

    def attend(self, query, key, value, scaling, variant=None):
        """A plain softmax takes the layer's decode attention; a softcap or sinks (``variant``, an
        :class:`~kvpop_hf.attention_variants.AttentionVariant`) the torch reference, which the Triton kernel is not."""
        if variant is None or variant.plain:
            return self.attention(query, key, value, self.seen, scaling)
        from .attention_variants import variant_attention

        mask = (torch.arange(key.shape[2], device=key.device) < self.seen[:, None]).view(key.shape[0], 1, 1, -1)
        return variant_attention(query, key, value, mask, scaling, variant)


def decode_slots_of(tensor: torch.Tensor) -> DecodeSlots | None:
    return getattr(tensor, DECODE_ATTRIBUTE, None)


def mark_decode_slots(keys: torch.Tensor, seen: torch.Tensor, attention: Callable) -> None:
    setattr(keys, DECODE_ATTRIBUTE, DecodeSlots(seen, attention))
