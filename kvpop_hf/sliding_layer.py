"""A KVpop layer on a sliding-window attention layer (``KVpopCache(..., sliding_layers="kvpop")``).

The layer keeps the usual fixed budget ``B = s + w + k`` per KV head (:class:`~kvpop_hf.layer.KVpopLayer`), and its
queries see the KVpop set *inside* the model's window ``W``: the query at position ``q`` attends to
``R(q) ∩ {t : q - W < t <= q}``. With ``w >= W`` (or a budget covering the sequence) that is exactly the model's
sliding-window attention; with a smaller budget the layer holds ``B`` entries where transformers' sliding layer
holds ``W``. Both the chunk path (the plan's per-head mask, dense SDPA or the variant reference) and the decode path
(a slot mask from the stored positions, the torch reference) add the window; FlexAttention and the Triton decode
kernel do not, so this layer never takes them (docs/hybrid_models.md). Needs ``attn_implementation="kvpop"``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .attention_variants import PLAIN, variant_attention
from .handoff import DECODE_ATTRIBUTE, DecodeSlots
from .layer import ChunkPlan, KVpopLayer

SLIDING_NEEDS_KVPOP_ATTENTION = (
    "KVpopCache: a KVpop layer on a sliding-window layer (sliding_layers='kvpop') was attended with a stock attention "
    "implementation (sdpa, eager, ...), which applies the window to slot indices, not positions. Load the model with "
    "attn_implementation='kvpop' (or model.set_attn_implementation('kvpop')), or build the cache with "
    "sliding_layers='window'. Then start again with cache.reset() (or a new cache)."
)


@dataclass
class SlidingChunkPlan(ChunkPlan):
    """A chunk plan whose queries see their KVpop set inside the sliding window ``attention_window``."""

    attention_window: int = 0

    def visibility(self) -> torch.Tensor:
        vis = super().visibility()
        q = self.query_pos[:, None, :, None]
        inside = self.pos[:, :, None, :] > q - self.attention_window
        return torch.where(q < 0, vis, vis & inside)  # a padding query keeps seeing itself

    def compact(self, *args, **kwargs):
        raise NotImplementedError("The compact (FlexAttention) mask of a sliding KVpop layer is not implemented; "
                                  "its chunks take the dense path (kvpop_hf.ops.chunk_attention.attend_chunk).")


@dataclass(frozen=True)
class SlidingDecodeSlots(DecodeSlots):
    """A decode step over all ``B`` slots where slot ``i`` is visible iff ``i < seen`` and its position lies in
    the window of the new token (``pos > seen - 1 - W``); always the torch reference."""

    pos: torch.Tensor = None
    window: int = 0

    def attend(self, query, key, value, scaling, variant=None):
        B = key.shape[2]
        seen = self.seen[:, None, None]  # [b, 1, 1]
        mask = (torch.arange(B, device=key.device) < seen) & (self.pos > seen - 1 - self.window)  # [b, h, B]
        return variant_attention(query, key, value, mask[:, :, None, :], scaling, variant or PLAIN)


class SlidingKVpopLayer(KVpopLayer):
    """:class:`~kvpop_hf.layer.KVpopLayer` whose queries see their set inside the window ``attention_window``."""

    is_sliding = True

    def __init__(self, shared, layer_idx: int, attention_window: int):
        super().__init__(shared, layer_idx)
        self.attention_window = int(attention_window)

    def _mark_static(self) -> None:
        super()._mark_static()
        plain = getattr(self.keys, DECODE_ATTRIBUTE)
        setattr(self.keys, DECODE_ATTRIBUTE, SlidingDecodeSlots(self.seen, plain.attention, self.pos,
                                                                self.attention_window))

    def commit_chunk(self, chunk, valid, cand_k=None, cand_v=None) -> SlidingChunkPlan:
        plan = super().commit_chunk(chunk, valid, cand_k, cand_v)
        return SlidingChunkPlan(**{f.name: getattr(plan, f.name) for f in fields(ChunkPlan)},
                                attention_window=self.attention_window)

    def flush(self) -> None:
        if self.pending is not None:  # no kvpop attention committed the chunk: a stock attention ran
            self.pending = None
            raise ValueError(SLIDING_NEEDS_KVPOP_ATTENTION)


def sliding_kvpop_layer(layer_cls, shared, scorer_layer: int, attention_window: int):
    """The KVpop layer of a sliding-window decoder layer; ValueError for storage classes that have none."""
    if layer_cls is not KVpopLayer:
        raise ValueError(f"sliding_layers='kvpop' is implemented for static-priority scorers; the policy "
                         f"{shared.config.scorer!r} ({layer_cls.__name__}) re-scores its entries every step. Use "
                         "sliding_layers='window' with it.")
    return SlidingKVpopLayer(shared, scorer_layer, attention_window)
