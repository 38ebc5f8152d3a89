"""Row operations on a cache of several rows: set up ``R`` rows, copy one row of another cache into some of them
(a prompt prefilled alone, or forked into ``n`` rows), reset rows. What :func:`kvpop_hf.generate_batch` builds on.

Every layer type a :class:`~kvpop_hf.cache.KVpopCache` holds is covered:

* KVpop layers (:class:`~kvpop_hf.layer.KVpopLayer`, its sliding variant): keys, values, positions, priorities,
  the per-row count ``seen`` and the scorer's state, per row. The layer's ``tokens`` counter (one for all rows,
  padding included) is not per row and is left as it is.
* transformers' ``StaticSlidingWindowLayer`` (a hybrid model's sliding-window layers under
  ``sliding_layers="window"``): its ``W`` slots hold the last ``W`` tokens of every row in order, oldest first,
  and the layer has one length for all rows. :func:`setup_rows` puts such a layer in the "full" state (its length
  ``T0 >= W``); :func:`copy_rows` writes a row's tokens at the *end* of the slots (right-aligned), so a row with
  fewer than ``W`` tokens has empty slots at the start, which the caller hides with a 2D attention mask (see
  :func:`window_mask`). The layer's length is then a virtual time shared by all rows: :func:`rewind` puts it back
  at ``T0`` after every step, so the mask never changes shape.
* transformers' linear-attention layers (``LinearAttentionLayer``: conv and recurrent states, fixed shapes):
  each state row is copied.

Any other layer type raises :class:`ValueError` (:func:`check_layers`).
"""

from __future__ import annotations

import torch

from .layer import KVpopLayer
from .sliding_layer import SlidingKVpopLayer

__all__ = ["check_layers", "setup_rows", "copy_rows", "reset_rows", "rewind", "window_mask", "virtual_length"]


def _kind(layer) -> str:
    from transformers.cache_utils import StaticSlidingWindowLayer

    if isinstance(layer, KVpopLayer):
        return "kvpop"
    if isinstance(layer, StaticSlidingWindowLayer):
        return "sliding"
    if hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states"):
        return "linear"
    return "other"


def check_layers(cache) -> dict[str, int]:
    """The count of each layer kind (``kvpop``, ``sliding``, ``linear``); ValueError for a layer of any other type
    or a KVpop layer of an attention-based policy (its entries are re-scored every step, with per-step state of
    another shape)."""
    counts = {"kvpop": 0, "sliding": 0, "linear": 0}
    for i, layer in enumerate(cache.layers):
        kind = _kind(layer)
        if kind == "other":
            raise ValueError(f"Layer {i} of this cache is a {type(layer).__name__}, which kvpop_hf's row operations "
                             "do not cover (KVpop layers, transformers' StaticSlidingWindowLayer and linear-attention "
                             "layers are).")
        if kind == "kvpop" and type(layer) not in (KVpopLayer, SlidingKVpopLayer):
            raise ValueError(f"The scorer {cache.kvpop_config.scorer!r} re-scores its entries every step "
                             f"({type(layer).__name__}); generate_batch and the row operations need a static-priority "
                             "scorer that decodes through the fixed-shape step (e.g. 'knorm', 'mlp', 'mlstm' or a "
                             "trained checkpoint).")
        counts[kind] += 1
    return counts


def virtual_length(cache) -> int:
    """``T0``: the length every sliding-window layer is kept at (its window, the largest one), 1 without one."""
    windows = [layer.max_cache_len for layer in cache.layers if _kind(layer) == "sliding"]
    return max(windows, default=1)


def _batch_of(layer) -> int | None:
    kind = _kind(layer)
    if kind in ("kvpop", "sliding"):
        return layer.keys.shape[0] if layer.is_initialized else None
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            return layer.conv_states[i].shape[0]
        if layer.is_recurrent_states_initialized[i]:
            return layer.recurrent_states[i].shape[0]
    return None


def cache_rows(cache) -> int | None:
    """The batch size the cache's buffers have, or None while it holds none."""
    for layer in cache.layers:
        b = _batch_of(layer)
        if b is not None:
            return b
    return None


@torch.no_grad()
def setup_rows(cache, like, rows: int) -> None:
    """Give every layer of ``cache`` buffers of ``rows`` rows shaped as those of ``like`` (a cache of the same model
    holding at least one row, e.g. a prompt prefilled alone), all rows empty, sliding layers at length ``T0``
    (:func:`virtual_length`). Buffers of the right batch size are kept (reset in place): compiled steps keep their
    addresses."""
    t0 = virtual_length(cache)
    for layer, src in zip(cache.layers, like.layers):
        kind = _kind(layer)
        if kind == "kvpop":
            src.flush()
            if layer.is_initialized and layer.keys.shape[0] == rows:
                layer.reset()
            else:
                layer.reset()
                k = src.keys[:1, :, :1].expand(rows, -1, -1, -1)
                v = src.values[:1, :, :1].expand(rows, -1, -1, -1)
                layer.lazy_initialization(k, v)
            layer.tokens.fill_(t0)
        elif kind == "sliding":
            if not (layer.is_initialized and layer.keys.shape[0] == rows):
                layer.lazy_initialization(src.keys[:1, :, :1].expand(rows, -1, -1, -1),
                                          src.values[:1, :, :1].expand(rows, -1, -1, -1))
            layer.keys.zero_()
            layer.values.zero_()
            _set_sliding_length(layer, t0)
        else:
            for i in range(src.number_of_states):
                conv = src.conv_states[i] if src.is_conv_states_initialized[i] else None
                rec = src.recurrent_states[i] if src.is_recurrent_states_initialized[i] else None
                have = _batch_of(layer)
                if have != rows:
                    layer.lazy_initialization(
                        conv_states=None if conv is None else conv[:1].expand(rows, *conv.shape[1:]),
                        recurrent_states=None if rec is None else rec[:1].expand(rows, *rec.shape[1:]),
                        state_idx=i, **({} if conv is None else {"conv_kernel_size": conv.shape[-1]}))
                if layer.is_conv_states_initialized[i]:
                    layer.conv_states[i].zero_()
                if layer.is_recurrent_states_initialized[i]:
                    layer.recurrent_states[i].zero_()
                layer.has_previous_state[i] = True
            layer.cumulative_length_linear.fill_(t0)


def _set_sliding_length(layer, length: int) -> None:
    layer.cumulative_length_int = length
    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        layer.cumulative_length.fill_(length)


def rewind(cache) -> None:
    """Put the sliding layers' (and the KVpop layers') shared length back at ``T0`` after a decode step (only needed
    where the cache has sliding-window layers: their mask sizes follow that length)."""
    t0 = virtual_length(cache)
    for layer in cache.layers:
        kind = _kind(layer)
        if kind == "sliding":
            _set_sliding_length(layer, t0)
        elif kind == "kvpop":
            layer.tokens.fill_(t0)


def window_mask(cache, positions: torch.Tensor) -> torch.Tensor:
    """The 2D attention mask ``[R, T0 + 1]`` of a decode step whose rows feed tokens at real ``positions [R]``
    (a row holds ``positions[r]`` tokens before the step): virtual index ``v`` is visible to row ``r`` iff
    ``v >= T0 - positions[r]``, i.e. exactly the row's own right-aligned tokens and the new one."""
    t0 = virtual_length(cache)
    v = torch.arange(t0 + 1, device=positions.device)
    return (v[None, :] >= (t0 - positions)[:, None]).long()


def _rows_index(dst_rows, device) -> torch.Tensor:
    return torch.as_tensor(dst_rows, dtype=torch.long, device=device).flatten()


@torch.no_grad()
def copy_rows(dst, src, dst_rows, src_row: int = 0) -> None:
    """Copy row ``src_row`` of cache ``src`` into rows ``dst_rows`` (an int or a list) of cache ``dst`` (both caches
    of the same model and budget; ``dst`` set up by :func:`setup_rows`). Afterwards each of those rows holds exactly
    the state ``src``'s row holds: decoding it gives what decoding ``src`` would."""
    if isinstance(dst_rows, int):
        dst_rows = [dst_rows]
    for layer, s in zip(dst.layers, src.layers):
        kind = _kind(layer)
        if kind == "kvpop":
            s.flush()
            idx = _rows_index(dst_rows, layer.keys.device)
            for name in ("keys", "values", "pos", "prio", "seen"):
                target, source = getattr(layer, name), getattr(s, name)
                target.index_copy_(0, idx, source[src_row:src_row + 1].expand(len(idx), *source.shape[1:]))
            for target, source in zip(layer.state or (), s.state or ()):
                target.index_copy_(0, idx, source[src_row:src_row + 1].expand(len(idx), *source.shape[1:]))
        elif kind == "sliding":
            W = layer.max_cache_len
            n = min(s.get_seq_length() if isinstance(s.get_seq_length(), int) else int(s.get_seq_length()), W)
            for target, source in ((layer.keys, s.keys), (layer.values, s.values)):
                row = torch.zeros_like(target[:1])
                if n:
                    row[:, :, W - n:] = source[src_row:src_row + 1, :, :n] if n < W else source[src_row:src_row + 1]
                idx = _rows_index(dst_rows, target.device)
                target.index_copy_(0, idx, row.expand(len(idx), *row.shape[1:]))
        else:
            for i in range(s.number_of_states):
                for states, inited in ((("conv_states"), "is_conv_states_initialized"),
                                       (("recurrent_states"), "is_recurrent_states_initialized")):
                    if getattr(s, inited)[i]:
                        target, source = getattr(layer, states)[i], getattr(s, states)[i]
                        idx = _rows_index(dst_rows, target.device)
                        target.index_copy_(0, idx, source[src_row:src_row + 1].expand(len(idx), *source.shape[1:]))


@torch.no_grad()
def reset_rows(cache, rows) -> None:
    """Empty rows ``rows`` of a set-up cache (the other rows are untouched)."""
    if isinstance(rows, int):
        rows = [rows]
    for layer in cache.layers:
        kind = _kind(layer)
        if kind == "kvpop":
            if not layer.is_initialized:
                continue
            idx = _rows_index(rows, layer.keys.device)
            layer.keys.index_fill_(0, idx, 0)
            layer.values.index_fill_(0, idx, 0)
            layer.pos.index_fill_(0, idx, -1)
            layer.prio.index_fill_(0, idx, float("-inf"))
            layer.seen.index_fill_(0, idx, 0)
            for t in layer.state or ():
                t.index_fill_(0, idx, 0)
        elif kind == "sliding":
            if layer.is_initialized:
                idx = _rows_index(rows, layer.keys.device)
                layer.keys.index_fill_(0, idx, 0)
                layer.values.index_fill_(0, idx, 0)
        else:
            for i in range(layer.number_of_states):
                for states, inited in (("conv_states", "is_conv_states_initialized"),
                                       ("recurrent_states", "is_recurrent_states_initialized")):
                    if getattr(layer, inited)[i]:
                        t = getattr(layer, states)[i]
                        t.index_fill_(0, _rows_index(rows, t.device), 0)
