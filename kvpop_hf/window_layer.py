"""The cache layer of a sliding-window layer that keeps the model's window (``sliding_layers="window"``).

:class:`WindowLayer` is transformers' fixed-size ``StaticSlidingWindowLayer`` (``W`` slots, the last ``W`` tokens in
position order, the same keys, values and mask sizes) with its count of tokens seen kept in the device tensor
``cumulative_length`` only. transformers' layer also keeps that count as a Python int (``cumulative_length_int``),
which a decode step reads and increments: inside a compiled step dynamo guards on its value, so the second step
recompiles and the count becomes a symbolic input of the graph that changes every step (which CUDA graphs record
anew for each value). Here a decode step is tensor ops only (fixed shapes, no host value), so a compiled decode step
of a hybrid model compiles once. Eager calls read the count from the tensor (a device synchronisation, as
``KVpopLayer.get_seq_length`` does); prompt chunks run eagerly, as a KVpop layer's do.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

__all__ = ["WindowLayer"]


class WindowLayer(StaticSlidingWindowLayer):
    """``StaticSlidingWindowLayer`` whose decode step is traceable without host state (see the module docstring)."""

    @property
    def cumulative_length_int(self):
        """Tokens seen: an int in eager code (read from the device), the 0-d tensor itself inside a compiled call."""
        if torch.compiler.is_compiling():
            return self.cumulative_length
        return int(self.cumulative_length)

    @cumulative_length_int.setter
    def cumulative_length_int(self, value) -> None:
        self.cumulative_length.fill_(value)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-2] == 1 and self.is_initialized:
            return self._decode_update(key_states, value_states)
        return self._update_eagerly(key_states, value_states)

    def _decode_update(self, key_states, value_states):
        """One token per row: before the window is full it goes to slot ``n`` (tokens seen), after it the slots shift
        left by one and it goes to the last slot; all ``W`` slots are returned (what ``StaticSlidingWindowLayer``
        returns for one token)."""
        W = self.max_cache_len
        n = self.cumulative_length
        full = (n >= W).long()
        # slot i takes slot i + 1 once full (the last slot's copy is overwritten right away)
        source = (torch.arange(W, device=self.keys.device) + full).clamp_max(W - 1)
        slot = n.clamp_max(W - 1).view(1)
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            shifted = buffer.index_select(2, source)
            shifted.index_copy_(2, slot, new.to(buffer.dtype))
            buffer.copy_(shifted)  # in place: the buffers keep their static addresses
        self.cumulative_length.add_(1)
        return self.keys, self.values

    @torch.compiler.disable
    def _update_eagerly(self, key_states, value_states):
        """The first allocation and prompt chunks, as ``StaticSlidingWindowLayer.update`` computes them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:
            return self._decode_update(key_states, value_states)
        W, L = self.max_cache_len, key_states.shape[-2]
        n = int(self.cumulative_length)
        self.cumulative_length.add_(L)
        if n >= W:  # already full: the last W - 1 stored tokens, then the new ones
            full_keys = torch.cat((self.keys[:, :, 1:], key_states), dim=-2)
            full_values = torch.cat((self.values[:, :, 1:], value_states), dim=-2)
        elif n + L > W:  # becoming full in this chunk
            full_keys = key_states if n == 0 else torch.cat((self.keys[:, :, :n], key_states), dim=-2)
            full_values = value_states if n == 0 else torch.cat((self.values[:, :, :n], value_states), dim=-2)
        else:
            position = torch.arange(L, device=self.keys.device) + n
            self.keys.index_copy_(2, position, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, position, value_states.to(self.values.dtype))
            return self.keys, self.values
        self.keys.copy_(full_keys[:, :, -W:])
        self.values.copy_(full_values[:, :, -W:])
        return full_keys, full_values  # every key of the chunk's queries, as transformers' layer returns them

    def get_mask_sizes(self, query_length: int):
        """As ``StaticSlidingWindowLayer``: ``(kv_length, kv_offset)``. Inside a compiled decode step the offset is a
        0-d tensor (the length is ``W``)."""
        W = self.max_cache_len
        if torch.compiler.is_compiling() and query_length == 1:
            return W, (self.cumulative_length - W + 1).clamp_min(0)
        n = self.cumulative_length_int
        kv_offset = max(n - W + 1, 0)
        if n >= W:
            return W + query_length - 1, kv_offset
        if n + query_length > W:
            return n + query_length, kv_offset
        return W, kv_offset

    def get_seq_length(self):
        if not self.is_initialized:
            return 0
        return self.cumulative_length_int

    def crop(self, tokens_to_remove: int) -> None:
        StaticLayer.crop(self, tokens_to_remove)  # the count lives in the tensor only
