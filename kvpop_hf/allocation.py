"""How many slots a KVpop layer allocates, and a clear refusal of buffers that cannot fit.

A layer needs no more long-range slots than a sequence can have eligible tokens: with at most ``n`` positions
(``max_position_embeddings``), tokens ``s <= t <= n - 1 - w`` can be eligible, so ``topk`` beyond
``n - s - w`` slots is never filled. The layer allocates ``s + w + min(topk, max(0, n - s - w))`` slots per KV
head; the eviction contract is unchanged for every sequence up to ``n`` tokens.
"""

from __future__ import annotations

import torch


def longest_sequence(model_config) -> int | None:
    """The model's ``max_position_embeddings`` (of its text config), or None where it names none."""
    if model_config is None:
        return None
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def slots_for_topk(sinks: int, window: int, topk: int, max_positions: int | None) -> int:
    """Long-range slots to allocate: ``topk``, bounded by the eligible tokens of the longest sequence."""
    if max_positions is None:
        return topk
    return min(topk, max(0, max_positions - sinks - window))


def layer_bytes(batch: int, kv_heads: int, slots: int, key_dim: int, value_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one layer's buffers: keys and values ``[b, h, B, d]``, positions (int64) and priorities (float32)."""
    element = torch.empty((), dtype=dtype).element_size()
    return batch * kv_heads * slots * ((key_dim + value_dim) * element + 8 + 4)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CUDA: free plus cached by torch; CPU: the kernel's MemAvailable), or None."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def too_large(layer_idx: int, need: int, free: int | None, slots: int, topk: int, max_positions: int | None,
              num_layers: int | None) -> str:
    bound = (f"max_position_embeddings={max_positions} bounds it to {slots} slots per KV head" if max_positions
             else "the model config names no max_position_embeddings to bound it")
    layers = f" ({need * num_layers / 2**30:.2f} GiB for all {num_layers} layers)" if num_layers else ""
    have = f", but only {free / 2**30:.2f} GiB are free" if free is not None else " and the allocation failed"
    return (f"KVpopCache layer {layer_idx} needs {need / 2**30:.2f} GiB for its buffers{layers} with topk={topk} "
            f"({bound}){have}. Choose a smaller topk (or window): the budget sinks + window + topk is allocated "
            "per KV head and batch row.")


def check_fits(layer_idx: int, need: int, device: torch.device, slots: int, topk: int,
               max_positions: int | None, num_layers: int | None) -> None:
    """A ValueError before allocating ``need`` bytes on ``device`` where they exceed its free memory."""
    free = available_bytes(device)
    if free is not None and need > free:
        raise ValueError(too_large(layer_idx, need, free, slots, topk, max_positions, num_layers))
