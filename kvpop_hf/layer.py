"""One decoder layer's fixed-budget KV storage: sinks, a protected window ring and k scored slots.

Slot layout per (batch row, KV head), ``B = s + w + k`` slots allocated once:

* ``[0, s)``        sinks: token ``t < s`` lives in slot ``t``;
* ``[s, s + w)``    window ring: token ``t >= s`` enters slot ``s + (t - s) % w``; the token it
  overwrites is exactly ``t - w``, the one leaving the window;
* ``[s + w, B)``    long-range slots: the best ``k`` eligible tokens by static priority.

Eviction contract (docs/design.md §1): the query at real position ``q`` attends to
``{t < s} ∪ {q-w < t <= q} ∪ TopK_k({s <= t <= q-w})`` by priority ``p_t``, ties to the newer token.
Because priorities are static, online eviction (newcomer vs. weakest slot) equals that top-k.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from .allocation import check_fits, layer_bytes, slots_for_topk, too_large
from .backends import INFERENCE_FIELDS
from .ops.chunk_attention import attend_chunk
from .ops.decode_attention import decode_attention_for
from .ops.decode_eviction import eviction_for, read_entry, ring_slot
from .handoff import Handoff, attach, mark_decode_slots
from .ops.priority import decayed_priorities
from .shared import copy_layer, offload_layer, prefetch_layer

NEG_INF = float("-inf")


CHUNK_IN_COMPILED_CALL = (
    "KVpopCache got a prompt chunk inside a torch.compile'd forward on CUDA. transformers' generate compiles "
    "the chunked prefill too (prefill_chunk_size with a compileable cache), and KVpop's eager chunk path breaks "
    "under CUDA graphs. Fill the prompt first with kvpop_hf.prefill_in_chunks(model, cache, input_ids, "
    "chunk_size, attention_mask) and then call generate without prefill_chunk_size (its decode steps stay "
    "compiled), or pass disable_compile=True to generate."
)


STOCK_ATTENTION_SHARED_POSITIONS = (
    "KVpopCache: a prompt chunk of a batch of {rows} rows was attended with a stock attention implementation (sdpa, "
    "eager, ...) and the model got no position_ids per row, so the cache cannot tell whether the batch is "
    "left-padded. A stock attention applies the attention mask to the cache's slots, which are not in position "
    "order, so padded rows would come out wrong without an error. For an unpadded batch pass position_ids with one "
    "row per batch row (e.g. torch.arange(n).expand(batch, n) + tokens seen) or use model.generate, which passes "
    "them; a left-padded batch needs attn_implementation='kvpop' (or model.set_attn_implementation('kvpop')), which "
    "handles padding exactly. Then start again with cache.reset() (or a new cache)."
)


def chunk_in_compiled_call_unsupported(key_states: torch.Tensor) -> bool:
    """Whether a prompt chunk may not run inside a compiled forward: on CUDA, where transformers compiles with
    CUDA graphs and the chunk path's graph breaks fail there (``kvpop_hf/prefill.py``). On other devices the
    chunk path runs eagerly inside the compiled call (checked on CPU by the tests)."""
    return key_states.is_cuda


@torch.compiler.disable
def _refuse_chunk_in_compiled_call() -> None:
    """Raised at run time (a ``raise`` traced by dynamo would only make it fall back to eager)."""
    raise RuntimeError(CHUNK_IN_COMPILED_CALL)


def attending_positions(qpos: torch.Tensor) -> torch.Tensor:
    """qpos ``[b, L]`` real position of each query (-1: padding) -> the position each query attends as: a padding
    query takes the last real position before it in its row (-1 where there is none). With a dense cache the padding
    mask hides only padding keys, so a padding query after real tokens sees all of them, as that real query does;
    ``generate`` reads such a query's logits for the first new token of a right-padded row."""
    return qpos.cummax(dim=-1).values


@dataclass
class ChunkPlan:
    """What a multi-token update leaves for the ``kvpop`` attention function (see attention.py).

    Candidates are the ``n_old`` stored slots followed by the ``L`` new tokens.
    pos ``[b,h,C]`` real positions (-1: none), order ``[b,h,C]`` candidate indices sorted best
    first, query_pos ``[b,L]`` the position each query attends as (:func:`attending_positions`: a padding query
    after a real one attends as the last real query before it, as a dense cache's padding mask lets it; -1: a
    padding query before any real one, which sees only itself).
    """

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    order: torch.Tensor
    query_pos: torch.Tensor
    sinks: int
    window: int
    topk: int

    def visibility(self) -> torch.Tensor:
        """Exact per-head mask ``[b, h, L, C]`` bool: query j sees candidate c iff c ∈ R(q_j)."""
        s, w, k = self.sinks, self.window, self.topk
        q = self.query_pos[:, None, :, None]  # [b,1,L,1]
        pos = self.pos[:, :, None, :]  # [b,h,1,C]
        pos_sorted = self.pos.gather(-1, self.order)[:, :, None, :]
        elig_sorted = (pos_sorted >= s) & (pos_sorted <= q - w)
        better = elig_sorted.cumsum(-1) - elig_sorted.long()
        keep_sorted = elig_sorted & (better < k)
        keep = torch.zeros_like(keep_sorted).scatter_(-1, self.order[:, :, None, :].expand_as(keep_sorted), keep_sorted)
        recent = (pos >= 0) & (pos <= q) & ((pos < s) | (pos > q - w))
        vis = keep | recent
        # a padding query before any real one sees only itself (its output is never used; this avoids empty rows)
        L = self.query_pos.shape[1]
        n_old = self.pos.shape[-1] - L
        own = torch.zeros_like(vis)
        own[..., torch.arange(L), n_old + torch.arange(L)] = True
        return torch.where(q < 0, own, vis)

    def compact(self, reference: bool = False, backend: str = "blocked"):
        """The same visibility without an ``[L x C]`` mask: a :class:`kvpop_hf.ops.flex_mask.CompactChunkMask`
        (``cand_rank``/``cand_pos [b,h,C]``, ``query_pos [b,L]``, ``cutoff [b,h,L]``) whose ``mask_mod``
        equals ``visibility()``. ``cutoff`` comes from :func:`kvpop_hf.ops.flex_mask.chunk_cutoff` (``backend``: its
        variant); ``reference=True`` uses the plain ``O(L*C)`` count instead."""
        from .ops.flex_mask import compact_chunk_mask

        return compact_chunk_mask(self.pos, self.order, self.query_pos, self.sinks, self.window, self.topk,
                                  reference=reference, backend=backend)


class PendingChunk(Handoff):
    """A multi-token update that waits for the padding of its queries before it is committed: the
    ``"chunk"`` hand-off (kvpop_hf/handoff.py).

    ``update`` cannot see the forward's padding mask; the ``kvpop`` attention function can (it gets
    it from the ``kvpop`` mask function of the same call). So ``update`` returns the candidates
    (stored slots, then the new tokens) with this object attached to the returned keys; the attention
    function calls :meth:`attend`, which commits the chunk with the padding (:meth:`commit`, giving the
    exact :class:`ChunkPlan`) and attends to it. When a stock attention runs instead, the layer commits the
    chunk itself at its next call, as unpadded. The hand-off belongs to the returned tensor: no module
    state, so two caches in two threads or a nested model cannot see each other's chunks.
    """

    kind = "chunk"

    def __init__(self, layer: "KVpopLayer", k_new: torch.Tensor, v_new: torch.Tensor, n_old: int,
                 position_ids: torch.Tensor | None = None):
        self._layer = weakref.ref(layer)  # the layer keeps the chunk, the chunk does not keep the layer
        self.k_new, self.v_new, self.n_old = k_new, v_new, n_old
        self.position_ids = position_ids  # the model's, where transformers passes them to update
        self.committed = False

    def commit(self, valid: torch.Tensor | None, cand_k: torch.Tensor | None = None,
               cand_v: torch.Tensor | None = None) -> ChunkPlan:
        """Write the chunk into the layer and return its plan (once). valid ``[b, L]`` (True: real token).

        The chunk keeps nothing afterwards: the returned keys refer to it, so holding the plan (which
        refers to the keys) would make a reference cycle that keeps every layer's candidates alive."""
        if self.committed:
            raise RuntimeError("This KVpopCache chunk was already committed (its attention ran twice).")
        layer = self._layer()
        if layer is None:
            raise RuntimeError("The KVpopCache of this chunk was deleted before its attention ran.")
        plan = layer.commit_chunk(self, valid, cand_k, cand_v)
        self.committed = True
        self.k_new = self.v_new = self.position_ids = None
        return plan

    def attend(self, query, key, value, valid, scaling, variant=None):
        """Commit with this forward's padding, then attend each query to ``R(q)`` per head (``variant``: softcap /
        sinks, :mod:`kvpop_hf.attention_variants`)."""
        layer = self._layer()
        backends = layer.backends if layer is not None else None  # commit raises when the layer is gone
        return attend_chunk(self.commit(valid, key, value), query, key, value, scaling, backends, variant)


class KVpopLayer(CacheLayerMixin):
    """Fixed-budget storage of one layer. Tensors (allocated once, updated in place, static addresses
    for CUDA graphs): keys/values ``[b, h, B, d]``, pos ``[b, h, B]`` int64 (-1 empty), prio
    ``[b, h, B]`` float32, seen ``[b]`` real tokens seen per row, tokens ``[]`` tokens seen including
    padding (what ``generate`` counts), and the scorer's state.

    Occupied slots of a row are always the prefix ``[0, min(seen, B))``: sinks and the window ring
    fill in position order and the long-range slots fill the first empty slot first. Decoding
    therefore returns all ``B`` slots (fixed shapes) and masks ``slot >= seen`` per row.
    """

    is_compileable = True
    is_sliding = False
    flush_at_next_layer = False  # a pending chunk is committed at this layer's next update

    def __init__(self, shared, layer_idx: int):
        """shared: the cache's :class:`~kvpop_hf.shared.KVpopShared` (config, scorer, decay); the layer keeps no
        reference to its cache, so ``copy.deepcopy`` of a cache (or a layer) is independent of the original."""
        super().__init__()
        self.shared = shared
        self.layer_idx = layer_idx
        cfg = shared.config
        self.sinks, self.window = cfg.sinks, cfg.window
        # no more long-range slots than the longest sequence can fill (kvpop_hf/allocation.py)
        self.topk = slots_for_topk(cfg.sinks, cfg.window, cfg.topk, getattr(shared, "max_positions", None))
        self.budget = self.sinks + self.window + self.topk
        self.tokens = torch.zeros((), dtype=torch.long)
        self.pending: PendingChunk | None = None
        self._full_on_host = False  # True once the host knows that all B slots are in use (no sync needed then)
        self.updates = 0  # eager updates, for the cache's layer-count check

    def __deepcopy__(self, memo):
        """A copy with its own tensors (keys, values, positions, priorities, counters, scorer state) that shares the
        scorer's read-only weights. A chunk still waiting for its attention is committed first (:meth:`flush`)."""
        self.flush()
        return copy_layer(self, memo, shared_modules=(getattr(self, "scorer", None),))

    # -- transformers layer API ----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.shared.check_shape(self.layer_idx, h, d)
        self.dtype, self.device = key_states.dtype, key_states.device
        B = self.budget
        cfg, max_positions = self.shared.config, getattr(self.shared, "max_positions", None)
        need = layer_bytes(b, h, B, d, value_states.shape[-1], key_states.dtype)
        check_fits(self.layer_idx, need, self.device, B, cfg.topk, max_positions, cfg.num_layers)
        try:
            self.keys = torch.zeros(b, h, B, d, dtype=key_states.dtype, device=self.device)
            self.values = torch.zeros(b, h, B, value_states.shape[-1], dtype=value_states.dtype, device=self.device)
            self.pos = torch.full((b, h, B), -1, dtype=torch.long, device=self.device)
            self.prio = torch.full((b, h, B), NEG_INF, dtype=torch.float32, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if isinstance(err, torch.OutOfMemoryError) or "alloc" in str(err).lower():
                raise ValueError(too_large(self.layer_idx, need, None, B, cfg.topk, max_positions,
                                           cfg.num_layers)) from err
            raise
        self.seen = torch.zeros(b, dtype=torch.long, device=self.device)
        self.tokens = self.tokens.to(self.device)
        self.scorer = scorer = self.shared.scorers.on(self.device)  # this layer's device: nothing moves per step
        self.state = scorer.init_state(self.layer_idx, b, self.device) if scorer.stateful else None
        # the inference implementations, chosen once for this device (docs/backends.md)
        self.backends = backends = self.shared.backends.resolve(self.device, INFERENCE_FIELDS)
        self._evict = eviction_for(backends.decode_eviction)
        self._decode_attention = decode_attention_for(backends.decode_attention)
        # the scorer's fused decode step, or None: the torch path
        self._scorer_step = scorer.decode_kernel(self.device) if backends.mlstm_step == "triton" else None
        self._mark_static()
        self.is_initialized = True

    def _buffers(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.pos, self.prio, self.seen, self.tokens] + list(self.state or ())

    def _mark_static(self) -> None:
        """Tag the buffers for CUDA graphs (fixed addresses) and tell the attention function, through
        the keys it is handed, where the per-row counts live (:class:`kvpop_hf.handoff.DecodeSlots`).

        Every dimension but the batch is also marked static: ``generate`` shares one compiled call between caches,
        and after a graph of another cache (a ``StaticCache`` of another length, whose buffers have the same
        names) dynamo's automatic dynamic shapes would otherwise make the slot dimension symbolic, which the
        Triton decode kernels of a CUDA graph do not compile with (inductor's ``KeyError: 'op25'``)."""
        mark_decode_slots(self.keys, self.seen, self._decode_attention)
        if not torch.compiler.is_compiling():
            for t in self._buffers():
                torch._dynamo.mark_static_address(t)
                for dim in range(1, t.dim()):
                    torch._dynamo.mark_static(t, dim)

    def get_seq_length(self) -> int:
        """Tokens seen, padding included, as an int (as `DynamicLayer`). Inside a compiled call it is the 0-d
        counter tensor itself (as `StaticLayer` returns it), so a traced forward neither breaks its graph nor
        waits for the device."""
        if not self.is_initialized:
            return 0
        return self.tokens if torch.compiler.is_compiling() else int(self.tokens)

    def get_max_length(self) -> int:
        return -1  # any sequence length fits: memory is fixed at B entries

    def stored_length(self) -> int:
        """Slots in use (a prefix of the layout): ``min(tokens, B)``. Syncs with the device until the host has
        seen the cache full (tokens only grow until ``reset``, and decode steps may run in a CUDA graph)."""
        if not self.is_initialized:
            return 0
        if not self._full_on_host:
            self._full_on_host = int(self.tokens) >= self.budget
        return self.budget if self._full_on_host else int(self.tokens)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1:
            # decoding: all B slots, slot i visible iff i <= tokens seen (the occupied prefix), as StaticLayer
            return self.budget, 0
        kv_length = self.stored_length() + query_length
        seen = int(self.tokens) if self.is_initialized else 0
        return kv_length, seen + query_length - kv_length

    def update(self, key_states, value_states, *args, **kwargs):
        """A decode step (one token per row) is traceable and fixed-shape; everything else -- the first
        allocation and prompt chunks -- runs eagerly, even inside a compiled forward (graph breaks): buffers
        allocated inside a CUDA graph would live in its memory pool and be overwritten by the next replay.
        A prompt chunk inside a compiled forward on CUDA is refused (:func:`chunk_in_compiled_call_unsupported`)."""
        if key_states.shape[2] == 1 and self.is_initialized:
            return self._decode_update(key_states, value_states)
        if torch.compiler.is_compiling() and chunk_in_compiled_call_unsupported(key_states):
            _refuse_chunk_in_compiled_call()
        return self._update_eagerly(key_states, value_states, **kwargs)

    @torch.compiler.disable
    def _update_eagerly(self, key_states, value_states, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] == 1:
            return self._decode_update(key_states, value_states)
        self._check_batch(key_states, value_states)
        self.flush()
        self.updates += 1
        # newer transformers hand the attention's kwargs (position_ids among them) to `update`
        position_ids = (kwargs.get("kwargs") or {}).get("position_ids")
        return self.begin_chunk(key_states, value_states, position_ids)

    def _decode_update(self, key_states, value_states):
        self._check_batch(key_states, value_states)
        self.flush()
        if not torch.compiler.is_compiling():
            self.updates += 1
        return self.decode_step(key_states, value_states)

    def _check_batch(self, key_states, value_states) -> None:
        """Another batch size or dtype than the buffers': new buffers after ``reset()``, else a ValueError."""
        other = key_states.shape[0] != self.keys.shape[0] or key_states.dtype != self.keys.dtype
        if other and self.updates == 0:
            self._reallocate(key_states, value_states)
        elif other:
            raise ValueError(self.reuse_error(key_states))

    def reuse_error(self, key_states) -> str | None:
        """Why a filled layer cannot take ``key_states`` (another batch size or dtype than an earlier generation
        left), or None (fine, or nothing to keep: not filled, or fresh from ``reset()``)."""
        if not self.is_initialized or self.updates == 0:
            return None
        if key_states.shape[0] != self.keys.shape[0]:
            return (f"This KVpopCache holds batch size {self.keys.shape[0]} from an earlier generation; call "
                    f"cache.reset() before using it with batch size {key_states.shape[0]} (or build a new cache).")
        if key_states.dtype != self.keys.dtype:
            return (f"This KVpopCache holds {str(self.keys.dtype).removeprefix('torch.')} keys from an earlier "
                    f"generation, but the model gives {str(key_states.dtype).removeprefix('torch.')}: call "
                    "cache.reset() (or build a new cache) before using it with this model.")
        return None

    @torch.compiler.disable
    def _reallocate(self, key_states, value_states) -> None:
        """New buffers for another batch size (a cache fresh from ``reset()``), outside any compiled graph."""
        self.lazy_initialization(key_states, value_states)

    def flush(self) -> None:
        """Commit a chunk that no ``kvpop`` attention committed (a stock attention ran): as unpadded. It warns (once)
        only where the chunk made the cache evict: otherwise the stock attention saw exactly each query's set.

        A stock attention never shows the cache the padding mask. Where the model handed its position ids
        to ``update`` and they show left padding (a row's positions do not count on from the tokens seen),
        the chunk was attended wrongly: that raises instead of going on silently; so does a batch of several rows
        whose position ids the model made itself (one row for all: the caller passed none, so padding cannot be
        told apart, and the attention mask of the next call would be applied to slots, not positions). Where the
        model did not hand them over (transformers
        5.17 passes only the keys and values), nothing that reaches the cache shows padding, so the warning
        of a batch of several rows says that padding goes unnoticed."""
        if self.pending is not None:
            self._refuse_padding_under_stock_attention(self.pending)
            chunk = self.pending
            evicted = chunk.n_old + chunk.k_new.shape[2] > self.budget  # else every query saw exactly its own set
            self.shared.warn_stock_attention(evicted, chunk.position_ids is None and chunk.k_new.shape[0] > 1)
            self.pending.commit(None)  # clears self.pending

    def _refuse_padding_under_stock_attention(self, chunk: "PendingChunk") -> None:
        if chunk.position_ids is None:
            return
        rows = chunk.k_new.shape[0]
        if rows > 1 and chunk.position_ids.shape[0] == 1:
            self.pending = None  # the cache cannot hold this chunk correctly; reset() before reuse
            raise ValueError(STOCK_ATTENTION_SHARED_POSITIONS.format(rows=rows))
        L = chunk.k_new.shape[2]
        start = int(self.tokens) - L  # tokens seen before the chunk
        expected = torch.arange(start, start + L, device=chunk.position_ids.device)
        if not bool((chunk.position_ids == expected).all()):
            self.pending = None  # the cache cannot hold this chunk correctly; reset() before reuse
            raise ValueError(
                "KVpopCache: this batch is padded (its position ids do not count on from the tokens seen), and a "
                "stock attention implementation does not show the padding to the cache, so padded rows would be "
                "wrong. Load the model with attn_implementation='kvpop' (or model.set_attn_implementation('kvpop')), "
                "which handles left padding exactly."
            )

    def reset(self) -> None:
        self.pending = None
        self._full_on_host = False
        self.updates = 0
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.pos.fill_(-1)
            self.prio.fill_(NEG_INF)
            self.seen.zero_()
            if self.state is not None:
                for t in self.state:
                    t.zero_()
        self.tokens.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices) -> None:
        """Keep the batch rows ``indices``: a tensor, list or tuple of row indices, or a bool mask (as `DynamicLayer`)."""
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.flush()
            self._replace_rows(lambda x: x.repeat_interleave(repeats, dim=0))

    def _select_batch(self, idx: torch.Tensor) -> None:
        if self.is_initialized:
            self.flush()
            idx = torch.as_tensor(idx, device=self.device)
            idx = idx.nonzero().flatten() if idx.dtype == torch.bool else idx.long().flatten()
            self._replace_rows(lambda x: x.index_select(0, idx))

    def _replace_rows(self, fn) -> None:
        for name in ("keys", "values", "pos", "prio", "seen"):
            setattr(self, name, fn(getattr(self, name)))
        if self.state is not None:
            self.state = tuple(fn(x) for x in self.state)
        self._mark_static()

    def offload(self) -> None:
        """Every tensor of the layer (keys, values, positions, priorities, counters, scorer state) to the CPU."""
        offload_layer(self)

    def prefetch(self) -> None:
        """Every tensor back to the layer's device, re-tagged for CUDA graphs."""
        prefetch_layer(self)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "KVpopCache evicts tokens permanently, so it cannot be cropped (assisted/speculative decoding "
            "and contrastive search need a cache that can roll back); use DynamicCache for those modes."
        )

    # -- priorities --------------------------------------------------------------------------
    def _priority(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``p_t = r_t - floor(t / n) * log_gamma_h`` (block-aligned recency decay, docs/design.md §1)."""
        log_gamma = self.shared.log_gamma_for(self.layer_idx, self.device)
        return decayed_priorities(scores, positions.clamp_min(0), log_gamma, self.shared.config.decay_step)

    def _score(self, k_new, v_new, valid_new, k_read, v_read, pos_read):
        """Scores of the tokens read at each new position; advances the stateful scorer in place."""
        scorer = self.scorer
        if scorer.stateful:
            state, r = scorer.absorb_and_read(self.layer_idx, self.state, k_new, v_new, valid_new, k_read, v_read)
            for old, new in zip(self.state, state):
                old.copy_(new)
        else:
            r = scorer.score(self.layer_idx, k_read, v_read, pos_read)
        return self._priority(r, pos_read)

    def _reads_at_entry(self) -> bool:
        scorer = self.scorer
        return scorer.stateful and not scorer.delayed

    # -- one new token per row: fixed shapes, in place, no host synchronisation ----------------
    def decode_step(self, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write token ``t = seen`` of every row, score the token leaving the window, keep the better of
        it and the weakest long-range slot (:mod:`kvpop_hf.ops.decode_eviction`). Returns all ``B`` slots
        (the keys' :class:`~kvpop_hf.handoff.DecodeSlots` mask the empty ones). k_new/v_new ``[b, h, 1, d]``."""
        s, w = self.sinks, self.window
        b, h = k_new.shape[:2]
        t = self.seen  # [b] real position of the new token
        slot = ring_slot(t, s, w).view(b, 1, 1).expand(b, h, 1)
        read_new = self._reads_at_entry()
        if self._scorer_step is not None:  # read, absorb, score and decay in one kernel; state updated in place
            p = self._scorer_step(self.scorer, self.layer_idx, self.state, self.keys, self.values, self.pos, t,
                                  k_new, v_new, s, w, self.shared.log_gamma_for(self.layer_idx, self.device),
                                  self.shared.config.decay_step, read_new)
        else:  # the new token, or the one leaving through that slot scored after absorbing t
            pos_r, k_r, v_r = read_entry(self.keys, self.values, self.pos, t, k_new, v_new, s, w, read_new)
            p = self._score(k_new, v_new, None, k_r, v_r, pos_r)
        # p scores the new token (read at entry) or the one leaving the window (delayed scoring)
        p_new, p_leave = (p, self.prio.gather(2, slot)) if read_new else (torch.full_like(p, NEG_INF), p)
        self._evict(self.keys, self.values, self.pos, self.prio, t, k_new, v_new, p_leave, p_new,
                         s, w, self.topk)
        self.seen.add_(1)
        self.tokens.add_(1)
        return self.keys, self.values

    # -- many new tokens: exact selection over old slots + new tokens ------------------------
    def begin_chunk(self, k_new: torch.Tensor, v_new: torch.Tensor, position_ids: torch.Tensor | None = None):
        """Return the candidates (the ``n_old`` stored slots, then the ``L`` new tokens) with a
        :class:`PendingChunk` attached to the keys (:func:`kvpop_hf.handoff.attach`); the state changes at its
        commit."""
        n_old = self.stored_length()
        cand_k = torch.cat([self.keys[:, :, :n_old], k_new.to(self.keys.dtype)], dim=2)
        cand_v = torch.cat([self.values[:, :, :n_old], v_new.to(self.values.dtype)], dim=2)
        self.pending = PendingChunk(self, k_new, v_new, n_old, position_ids)
        attach(cand_k, self.pending)
        self.tokens.add_(k_new.shape[2])
        self._full_on_host = n_old + k_new.shape[2] >= self.budget
        return cand_k, cand_v

    def commit_chunk(self, chunk: PendingChunk, valid: torch.Tensor | None, cand_k=None, cand_v=None) -> ChunkPlan:
        """Select what stays after the chunk and write it into the buffers; returns the chunk's plan."""
        if self.pending is not chunk:
            raise RuntimeError(
                "A KVpopCache chunk was committed out of order: the layer has received newer tokens since. "
                "Each forward's attention must run before the next forward updates the same cache."
            )
        self.pending = None
        s, w, k = self.sinks, self.window, self.topk
        k_new, v_new, n_old = chunk.k_new, chunk.v_new, chunk.n_old
        b, h, L, d = k_new.shape
        dev = k_new.device
        if cand_k is None:
            cand_k = torch.cat([self.keys[:, :, :n_old], k_new.to(self.keys.dtype)], dim=2)
            cand_v = torch.cat([self.values[:, :, :n_old], v_new.to(self.values.dtype)], dim=2)
        if valid is None:
            valid = torch.ones(b, L, dtype=torch.bool, device=dev)
        elif tuple(valid.shape) != (b, L):
            raise ValueError(f"Padding mask of shape {tuple(valid.shape)} does not fit a chunk of {b} x {L} tokens.")
        valid = valid.to(dev)
        C = n_old + L
        n_real = valid.sum(-1)  # [b]
        n_pad = L - n_real
        qpos = torch.where(valid, self.seen[:, None] + valid.long().cumsum(-1) - 1, -1)  # [b, L]

        cand_pos = torch.cat([self.pos[:, :, :n_old], qpos[:, None, :].expand(b, h, L)], dim=2)
        cand_prio = torch.cat([self.prio[:, :, :n_old], self.prio.new_full((b, h, L), NEG_INF)], dim=2)

        # the token leaving the window at each query: u = q - w (old ring slot or a new token)
        u = qpos - w  # [b, L]
        has_leave = valid & (u >= s)
        old_slot = s + torch.remainder(u - s, w)
        new_idx = n_old + n_pad[:, None] + (u - self.seen[:, None])
        leave_idx = torch.where(u < self.seen[:, None], old_slot, new_idx)
        leave_idx = torch.where(has_leave, leave_idx, 0).clamp(0, C - 1)
        leave_at = leave_idx[:, None, :].expand(b, h, L)
        k_leave = cand_k.gather(2, leave_at[..., None].expand(b, h, L, d))
        v_leave = cand_v.gather(2, leave_at[..., None].expand(b, h, L, cand_v.shape[-1]))
        pos_leave = cand_pos.gather(2, leave_at)

        discard = torch.full_like(leave_at, C)  # scatter target for queries without a leaving token
        target = torch.where(has_leave[:, None, :], leave_at, discard)
        prio_ext = torch.cat([cand_prio, cand_prio.new_full((b, h, 1), NEG_INF)], dim=2)
        if self._reads_at_entry():
            p_entry = self._score(k_new, v_new, valid, k_new, v_new, qpos[:, None, :].expand(b, h, L))
            prio_ext[:, :, n_old:C] = torch.where(valid[:, None, :], p_entry, NEG_INF)
            p_leave = prio_ext.gather(2, leave_at)
        else:
            p_leave = self._score(k_new, v_new, valid, k_leave, v_leave, pos_leave)
        prio_ext.scatter_(2, target, p_leave)
        cand_prio = prio_ext[:, :, :C]

        q_end = (self.seen + n_real - 1)[:, None, None]  # [b,1,1]
        order = self.keep_selection(cand_k, cand_v, cand_pos, cand_prio, q_end)
        self.seen.add_(n_real)
        return ChunkPlan(cand_k, cand_v, cand_pos, order, attending_positions(qpos), s, w, k)

    def keep_selection(self, cand_k, cand_v, cand_pos, cand_prio, q_end) -> torch.Tensor:
        """Write what stays at a chunk's end into the buffers: sinks, the window ending at ``q_end [b,1,1]`` and
        the best ``k`` eligible candidates by ``cand_prio [b,h,C]`` (ties to the newer position) in slot
        order; cand_k/cand_v ``[b,h,C,d]``, cand_pos ``[b,h,C]`` (-1: none). Returns the candidate order
        ``[b,h,C]`` (best first)."""
        s, w, k, B = self.sinks, self.window, self.topk, self.budget
        b, h, C, d = cand_k.shape
        # rank candidates: priority descending, ties to the newer (larger) position
        by_pos = cand_pos.argsort(dim=-1, descending=True, stable=True)
        order = by_pos.gather(-1, cand_prio.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True))

        # final state: the selection at each row's last real query
        pos_sorted = cand_pos.gather(-1, order)
        elig_sorted = (pos_sorted >= s) & (pos_sorted <= q_end - w)
        kept_before = elig_sorted.cumsum(-1) - elig_sorted.long()
        keep_sorted = elig_sorted & (kept_before < k)
        dest_sorted = torch.where(keep_sorted, s + w + kept_before, B)
        dest = torch.empty_like(dest_sorted).scatter_(-1, order, dest_sorted)
        is_sink = (cand_pos >= 0) & (cand_pos < s)
        in_window = (cand_pos >= s) & (cand_pos > q_end - w) & (cand_pos <= q_end)
        dest = torch.where(is_sink, cand_pos, dest)
        dest = torch.where(in_window, s + torch.remainder(cand_pos - s, w), dest)

        new_k = cand_k.new_zeros(b, h, B + 1, d).scatter_(2, dest[..., None].expand(b, h, C, d), cand_k)
        new_v = cand_v.new_zeros(b, h, B + 1, cand_v.shape[-1]).scatter_(
            2, dest[..., None].expand(b, h, C, cand_v.shape[-1]), cand_v)
        new_pos = cand_pos.new_full((b, h, B + 1), -1).scatter_(2, dest, cand_pos)
        new_prio = cand_prio.new_full((b, h, B + 1), NEG_INF).scatter_(2, dest, cand_prio)
        self.keys.copy_(new_k[:, :, :B])
        self.values.copy_(new_v[:, :, :B])
        self.pos.copy_(new_pos[:, :, :B])
        self.prio.copy_(new_prio[:, :, :B])
        return order
