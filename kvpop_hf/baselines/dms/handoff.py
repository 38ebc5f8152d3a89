"""What a DMS cache layer hands to the ``kvpop`` attention: the exact per-head visibility of one call.

``DMSLayer.update`` returns the keys/values the attention must read with one of these ``"dms"`` hand-offs
attached (:mod:`kvpop_hf.handoff`); ``kvpop_attention`` calls its ``attend``. Decode steps have already written their token (the
visible entries are the live slots); a prompt chunk is written when its attention runs, since only then is
the forward's padding known. A hand-off never attended means a stock attention ran, which cannot see the
per-head visibility: the layer raises at its next use (docs/design.md §9).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ...handoff import LayerHandoff
from .mask import hard_visibility

STOCK_ATTENTION = (
    "DMSCache keeps a different set of tokens for every KV head (ragged memory), which only the 'kvpop' attention "
    "implementation can mask; a stock attention (sdpa, eager, flash) ran instead. Load the model with "
    "attn_implementation='kvpop' (or call model.set_attn_implementation('kvpop')) and start again with a new cache "
    "(or cache.reset())."
)


def masked_attention(query, key, value, visible, scaling):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]``, visible ``[b, Hkv, L, C]`` bool (shared by the query
    heads of a KV head) -> ``[b, L, Hq, d]``."""
    b, hq, L, d = query.shape
    hkv, C = key.shape[1], key.shape[2]
    g = hq // hkv
    q = query.reshape(b, hkv, g * L, d)
    mask = visible[:, :, None].expand(b, hkv, g, L, C).reshape(b, hkv, g * L, C)
    out = F.scaled_dot_product_attention(q, key.to(query.dtype), value.to(query.dtype), attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, L, value.shape[-1]).transpose(1, 2).contiguous()


class _Handoff(LayerHandoff):
    kind = "dms"
    cache_name = "DMSCache"


class DMSDecode(_Handoff):
    """A decode step: the new token is stored; every live slot (``pos >= 0``) is visible."""

    def attend(self, query, key, value, valid, scaling):
        layer = self.layer()
        out = masked_attention(query, key, value, (layer.pos >= 0)[:, :, None, :], scaling)
        self.finished()
        return out


class DMSChunk(_Handoff):
    """A prompt chunk: candidates are the ``n_old`` stored slots, then the ``L`` new tokens with their
    decisions ``evict_new [b, h, L]``."""

    def __init__(self, layer, n_old: int, evict_new: torch.Tensor):
        super().__init__(layer)
        self.n_old, self.evict_new = n_old, evict_new

    def attend(self, query, key, value, valid, scaling):
        layer = self.layer()
        b, h, C = key.shape[0], key.shape[1], key.shape[2]
        L = C - self.n_old
        if valid is None:
            valid = torch.ones(b, L, dtype=torch.bool, device=key.device)
        elif tuple(valid.shape) != (b, L):
            raise ValueError(f"Padding mask of shape {tuple(valid.shape)} does not fit a chunk of {b} x {L} tokens.")
        valid = valid.to(key.device)
        query_pos = torch.where(valid, layer.seen[:, None] + valid.long().cumsum(-1) - 1, -1)  # [b, L]
        cand_pos = torch.cat([layer.pos, query_pos[:, None, :].expand(b, h, L)], dim=2)
        cand_evict = torch.cat([layer.evict, self.evict_new & (query_pos >= layer.sinks)[:, None, :]], dim=2)
        # a padding query after real ones attends as the last real query before it (as with a DynamicCache)
        attend_pos = query_pos.cummax(dim=-1).values
        visible = hard_visibility(attend_pos, cand_pos, cand_evict, layer.sinks, layer.window)
        own = torch.zeros_like(visible)  # a padding query before any real one sees only itself (output never used)
        own[..., torch.arange(L), self.n_old + torch.arange(L)] = True
        visible = torch.where((attend_pos < 0)[:, None, :, None], own, visible)
        out = masked_attention(query, key, value, visible, scaling)
        layer.commit(key, value, cand_pos, cand_evict, valid)
        self.finished()
        return out
