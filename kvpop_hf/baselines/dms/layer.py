"""One decoder layer's DMS storage: per (row, KV head) the live tokens only, so memory per head is ragged.

DMS (Łańcucki et al., 2025; baseline of KVpop, arXiv:2607.05061): every token gets a hard decision when it is
written, ``evict_t = logit_t > 0`` (``alpha_t > 1/2``, the gate of :mod:`kvpop_hf.baselines.dms.gate`); a token marked
for eviction stays while it is one of the last ``w`` tokens and is dropped when it leaves that window; the first
``s`` tokens (sinks) are never evicted. Query ``q`` therefore attends to

    {t < s}  ∪  {q - w < t <= q}  ∪  {s <= t <= q - w : not evict_t}

Storage: keys/values ``[b, h, N, d]``, positions ``pos [b, h, N]`` (-1: free slot), decisions ``evict [b, h, N]``,
``seen [b]`` real tokens per row, ``tokens []`` tokens including padding, ``marked [b, h]`` tokens marked for
eviction. ``N`` is the largest number of live entries over rows and heads (plus slack from growing): a decode
step first frees the marked token that leaves the window, then writes the new token into the first free slot of
each head (growing ``N`` only when some head has none), so freed memory is reused and never attended. A prompt
chunk rewrites the storage compacted to the live entries.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ...shared import copy_layer, offload_layer, prefetch_layer
from ...handoff import attach
from .handoff import STOCK_ATTENTION, DMSChunk, DMSDecode


class DMSLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, dms_config, gates, layer_idx: int):
        """dms_config: the cache's :class:`DMSConfig` (budget and model shape); gates: the cache's
        :class:`~kvpop_hf.shared.DeviceCopies` of its gate. No reference to the cache: deep copies are independent."""
        super().__init__()
        self.config, self.gates = dms_config, gates
        self.layer_idx = layer_idx
        self.sinks, self.window = dms_config.sinks, dms_config.window
        self.tokens = torch.zeros((), dtype=torch.long)
        self.pending = None
        self.updates = 0

    def __deepcopy__(self, memo):
        """Own tensors, shared read-only gate weights; a stock-attention step not yet caught raises here."""
        self.flush()
        return copy_layer(self, memo, shared_modules=(getattr(self, "gate", None),))

    # -- transformers layer API ----------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, _, d = key_states.shape
        if (h, d) != (self.config.num_kv_heads, self.config.head_dim):
            raise ValueError(f"Layer {self.layer_idx} has {h} KV heads of size {d}, but this DMSCache was built for "
                             f"{self.config.num_kv_heads} heads of size {self.config.head_dim}.")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(b, h, 0, d)
        self.values = value_states.new_zeros(b, h, 0, value_states.shape[-1])
        self.pos = torch.full((b, h, 0), -1, dtype=torch.long, device=self.device)
        self.evict = torch.zeros(b, h, 0, dtype=torch.bool, device=self.device)
        self.seen = torch.zeros(b, dtype=torch.long, device=self.device)
        self.marked = torch.zeros(b, h, dtype=torch.long, device=self.device)
        self.tokens = self.tokens.to(self.device)
        self.gate = self.gates.on(self.device)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        """Tokens seen, padding included, as an int (the counter tensor inside a compiled call)."""
        if not self.is_initialized:
            return 0
        return self.tokens if torch.compiler.is_compiling() else int(self.tokens)

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.keys.shape[2] if self.is_initialized else 0
        seen = int(self.tokens) if self.is_initialized else 0
        kv_length = stored + (query_length if query_length > 1 else 0)
        return max(kv_length, 1), seen + query_length - max(kv_length, 1)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"DMSCache was filled with batch size {self.keys.shape[0]} but got {key_states.shape[0]}; "
                             "call `cache.reset()` (or use a new cache) for a different batch.")
        self.flush()
        self.updates += 1
        evict = self.gate(self.layer_idx, value_states) > 0  # [b, h, L]: alpha > 1/2
        if key_states.shape[2] == 1 and int(self.tokens) > 0:
            return self.decode_step(key_states, value_states, evict)
        return self.begin_chunk(key_states, value_states, evict)

    def flush(self) -> None:
        """A hand-off never attended: a stock attention ran and could not mask the ragged heads."""
        if self.pending is not None and not self.pending.done:
            self.pending = None
            raise ValueError(STOCK_ATTENTION)
        self.pending = None

    # -- decoding: free the marked token leaving the window, write the new one into a free slot ----
    def decode_step(self, k_new, v_new, evict_new):
        """k_new/v_new ``[b, h, 1, d]``, evict_new ``[b, h, 1]`` bool; the new token is ``t = seen`` per row."""
        t = self.seen[:, None, None]  # [b, 1, 1]
        expired = self.evict & (self.pos >= 0) & (self.pos <= t - self.window)
        self.pos.masked_fill_(expired, -1)
        self.evict.masked_fill_(expired, False)
        free = self.pos < 0
        if not bool(free.any(-1).all()):
            self._grow(max(16, self.keys.shape[2] // 4))
            free = self.pos < 0
        slot = free.int().argmax(-1, keepdim=True)  # [b, h, 1]: first free slot of each head
        b, h, _, d = k_new.shape
        self.keys.scatter_(2, slot[..., None].expand(b, h, 1, d), k_new.to(self.keys.dtype))
        self.values.scatter_(2, slot[..., None].expand(b, h, 1, v_new.shape[-1]), v_new.to(self.values.dtype))
        e = evict_new & (t >= self.sinks)
        self.pos.scatter_(2, slot, t.expand(b, h, 1).contiguous())
        self.evict.scatter_(2, slot, e)
        self.marked += e[..., 0].long()
        self.seen += 1
        self.tokens += 1
        keys = self.keys.view_as(self.keys)  # a fresh tensor object carries this step's hand-off
        self.pending = DMSDecode(self)
        return attach(keys, self.pending), self.values

    def _grow(self, extra: int) -> None:
        b, h, N, d = self.keys.shape
        self.keys = torch.cat([self.keys, self.keys.new_zeros(b, h, extra, d)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(b, h, extra, self.values.shape[-1])], dim=2)
        self.pos = torch.cat([self.pos, self.pos.new_full((b, h, extra), -1)], dim=2)
        self.evict = torch.cat([self.evict, self.evict.new_zeros(b, h, extra)], dim=2)

    # -- prompt chunks: attend with the exact per-head rule, then keep the live entries -----------
    def begin_chunk(self, k_new, v_new, evict_new):
        cand_k = torch.cat([self.keys, k_new.to(self.keys.dtype)], dim=2)
        cand_v = torch.cat([self.values, v_new.to(self.values.dtype)], dim=2)
        self.pending = DMSChunk(self, self.keys.shape[2], evict_new)
        attach(cand_k, self.pending)
        self.tokens += k_new.shape[2]
        return cand_k, cand_v

    def commit(self, cand_k, cand_v, cand_pos, cand_evict, valid) -> None:
        """Keep the candidates still visible to the next query: live, and unmarked, a sink, or in the window
        ending at each row's last real token; stored in position order, ``N`` = the largest head."""
        n_real = valid.sum(-1)
        q_end = (self.seen + n_real - 1)[:, None, None]
        keep = (cand_pos >= 0) & ((cand_pos < self.sinks) | (cand_pos > q_end - self.window) | ~cand_evict)
        new_tokens = cand_pos[:, :, self.keys.shape[2]:] >= 0
        self.marked += (cand_evict[:, :, self.keys.shape[2]:] & new_tokens).sum(-1)
        N = int(keep.sum(-1).max()) if keep.numel() else 0
        big = torch.iinfo(torch.long).max
        order = torch.where(keep, cand_pos, big).argsort(dim=-1, stable=True)[..., :N]  # kept first, by position
        b, h, _, d = cand_k.shape
        self.keys = cand_k.gather(2, order[..., None].expand(b, h, N, d)).contiguous()
        self.values = cand_v.gather(2, order[..., None].expand(b, h, N, cand_v.shape[-1])).contiguous()
        kept = keep.gather(2, order)
        self.pos = torch.where(kept, cand_pos.gather(2, order), -1)
        self.evict = kept & cand_evict.gather(2, order)
        self.seen += n_real

    # -- bookkeeping -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.pending = None
        self.updates = 0
        if self.is_initialized:
            b, h, _, d = self.keys.shape
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
            self.pos, self.evict = self.pos[:, :, :0], self.evict[:, :, :0]
            self.seen.zero_()
            self.marked.zero_()
        self.tokens.zero_()

    def reorder_cache(self, beam_idx) -> None:
        self._replace_rows(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices) -> None:
        self._replace_rows(lambda x: x.index_select(0, indices.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._replace_rows(lambda x: x.repeat_interleave(repeats, dim=0))

    def _replace_rows(self, fn) -> None:
        if not self.is_initialized:
            return
        self.flush()
        for name in ("keys", "values", "pos", "evict", "seen", "marked"):
            setattr(self, name, fn(getattr(self, name)))

    def offload(self) -> None:
        """Every tensor of the layer (keys, values, positions, decisions, counters) to the CPU."""
        offload_layer(self)

    def prefetch(self) -> None:
        prefetch_layer(self)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("DMSCache evicts tokens permanently, so it cannot be cropped (assisted/speculative "
                                  "decoding and contrastive search need a cache that can roll back).")

    def live(self) -> torch.Tensor:
        """Live entries per row and head ``[b, h]``."""
        return (self.pos >= 0).sum(-1)
