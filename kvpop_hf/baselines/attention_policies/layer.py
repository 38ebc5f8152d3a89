"""The storage of the dynamic-score policies (TOVA, H2O, SnapKV): scores taken from attention, per step.

Same slots as :class:`kvpop_hf.layer.KVpopLayer` (sinks ``[0, s)``, window ring ``[s, s+w)``, long-range
``[s+w, B)``; occupied slots a prefix) and the same ``B`` fixed entries per (row, KV head), but ``prio``
holds the policy's *current* score of each entry, which the ``kvpop`` attention updates after every
call (docs/design.md §7):

* decode step ``t``: the token leaving the window (``t - w``) and the weakest long-range entry compete
  with the scores recorded by query ``t - 1`` (ties: the older one goes), then token ``t`` is written
  and attends to all ``B`` slots; its group-averaged probabilities ``[b, Hkv, B]`` update ``prio``
  (TOVA: replace, by default with the mean over all the layer's heads; H2O: add; SnapKV: nothing, new tokens
  score -inf).
* prompt chunk: each real query attends to every stored entry and every chunk token up to its own
  position (full causal, ``C = n_old + L`` candidates); at the chunk's end the policy's votes give the
  candidates' scores and the layer keeps the sinks, the window and the best ``k`` others.

The scores exist only through the ``kvpop`` attention: the ``"scores"`` hand-offs below travel on the keys
(:mod:`kvpop_hf.handoff`) and a step whose hand-off was never finished (a stock attention ran) raises at the
next layer's update (or the next forward, or ``stored_positions``).
"""

from __future__ import annotations

import torch

from ...ops.decode_eviction import ring_slot
from ...handoff import LayerHandoff, attach
from ...layer import NEG_INF, KVpopLayer
from .scores import attend_and_score

STOCK_ATTENTION = (
    "KVpopCache with the attention-based policy {name!r} takes its scores from the attention probabilities, "
    "which only the 'kvpop' attention implementation hands back; a stock attention (sdpa, eager, flash) ran "
    "instead. Load the model with attn_implementation='kvpop' (or call model.set_attn_implementation('kvpop')) "
    "and start again with a new cache (or cache.reset())."
)


class _Handoff(LayerHandoff):
    """Base of the per-call ``"scores"`` hand-offs: :meth:`attend` attends, then hands the policy's votes back
    through :meth:`finish` (:func:`~kvpop_hf.baselines.attention_policies.scores.attend_and_score`)."""

    kind = "scores"
    cache_name = "KVpopCache"

    def attend(self, query, key, value, valid, scaling):
        return attend_and_score(self, query, key, value, valid, scaling)


class DecodeScores(_Handoff):
    """A decode step's hand-off: the query is token ``seen - 1``, every stored slot is a candidate."""

    def begin(self, valid, key, value):
        layer = self.layer()
        query_pos = (layer.seen - 1)[:, None]  # [b, 1]
        return layer.pos, query_pos, torch.ones_like(query_pos, dtype=torch.float32)

    def finish(self, votes: torch.Tensor) -> None:
        layer = self.layer()
        new = layer.scorer.decode_update(layer.prio, votes, layer.pos)
        layer.prio.copy_(torch.where(layer.pos >= 0, new, NEG_INF))
        self.finished()


class ChunkScores(_Handoff):
    """A prompt chunk's hand-off: candidates are the ``n_old`` stored slots, then the ``L`` new tokens."""

    def __init__(self, layer, L: int, n_old: int):
        super().__init__(layer)
        self.L, self.n_old = L, n_old

    def begin(self, valid, key, value):
        layer = self.layer()
        b, h, n_old, L = key.shape[0], key.shape[1], self.n_old, self.L
        if valid is None:
            valid = torch.ones(b, L, dtype=torch.bool, device=key.device)
        elif tuple(valid.shape) != (b, L):
            raise ValueError(f"Padding mask of shape {tuple(valid.shape)} does not fit a chunk of {b} x {L} tokens.")
        self.valid = valid = valid.to(key.device)
        self.query_pos = torch.where(valid, layer.seen[:, None] + valid.long().cumsum(-1) - 1, -1)  # [b, L]
        self.cand_pos = torch.cat([layer.pos[:, :, :n_old], self.query_pos[:, None, :].expand(b, h, L)], dim=2)
        self.key, self.value = key, value
        return self.cand_pos, self.query_pos, layer.scorer.query_weights(valid)

    def finish(self, votes: torch.Tensor) -> None:
        layer = self.layer()
        layer.commit_scores(self, votes)
        self.finished()
        self.key = self.value = None  # the keys refer to this hand-off: no cycle left behind


class DynamicScoreLayer(KVpopLayer):
    """Fixed-budget storage whose scores change every step (TOVA, H2O, SnapKV). Buffers as the static layer:
    keys/values ``[b, h, B, d]``, pos ``[b, h, B]`` (-1 empty), prio ``[b, h, B]`` float32 (the policy's
    current score of each entry, -inf for empty slots), seen ``[b]``, tokens ``[]``. Decode shapes are fixed
    but the step is not captured as a graph (``is_compileable = False``): the hand-off is a Python object."""

    is_compileable = False
    flush_at_next_layer = True  # the cache flushes layer i at layer i+1's update: a stock attention raises at once

    def flush(self) -> None:
        """A call whose attention never handed its scores back: a stock attention ran."""
        if self.pending is not None and not self.pending.done:
            self.pending = None
            raise ValueError(STOCK_ATTENTION.format(name=self.shared.config.scorer))
        self.pending = None

    def decode_step(self, k_new: torch.Tensor, v_new: torch.Tensor):
        """Token ``t = seen`` per row: the token leaving the window competes with the weakest long-range slot on
        the current scores (one eviction), then ``t`` takes its ring slot. k_new/v_new ``[b, h, 1, d]``."""
        s, w = self.sinks, self.window
        b, h = k_new.shape[:2]
        slot = ring_slot(self.seen, s, w).view(b, 1, 1).expand(b, h, 1)
        p_leave = self.prio.gather(2, slot)
        p_new = torch.full_like(p_leave, self.scorer.new_token_score)
        self._evict(self.keys, self.values, self.pos, self.prio, self.seen, k_new, v_new, p_leave, p_new,
                    s, w, self.topk)
        self.seen.add_(1)
        self.tokens.add_(1)
        attach(self.keys, None)
        if self.scorer.decode_scores:
            self.pending = DecodeScores(self)
            attach(self.keys, self.pending)
        return self.keys, self.values

    def begin_chunk(self, k_new: torch.Tensor, v_new: torch.Tensor, position_ids=None):
        """Return the candidates (stored slots, then the new tokens) with a :class:`ChunkScores` attached."""
        n_old = self.stored_length()
        cand_k = torch.cat([self.keys[:, :, :n_old], k_new.to(self.keys.dtype)], dim=2)
        cand_v = torch.cat([self.values[:, :, :n_old], v_new.to(self.values.dtype)], dim=2)
        self.pending = ChunkScores(self, k_new.shape[2], n_old)
        attach(cand_k, self.pending)
        self.tokens.add_(k_new.shape[2])
        return cand_k, cand_v

    def commit_scores(self, chunk: ChunkScores, votes: torch.Tensor) -> None:
        """Score the candidates with the chunk's votes ``[b, h, C]`` and keep the sinks, the window and the best
        ``k`` others at each row's last real query (:meth:`KVpopLayer.keep_selection`)."""
        n_old, cand_pos = chunk.n_old, chunk.cand_pos
        b, h, C = cand_pos.shape
        old = self.prio[:, :, :n_old]
        scores = self.scorer.chunk_scores(old, votes, cand_pos, n_old)
        n_real = chunk.valid.sum(-1)  # [b]
        old_ext = torch.cat([old, old.new_full((b, h, C - n_old), NEG_INF)], dim=2)
        scores = torch.where((n_real > 0)[:, None, None], scores, old_ext)  # a row of padding only keeps its scores
        scores = torch.where(cand_pos >= 0, scores, NEG_INF)
        q_end = (self.seen + n_real - 1)[:, None, None]
        self.keep_selection(chunk.key, chunk.value, cand_pos, scores, q_end)
        self.seen.add_(n_real)
