"""Chunked prefill outside any compiled call, for ``generate`` to continue with compiled decoding.

On CUDA, ``model.generate(..., **with_cache(model, KVpopCache(...)))`` compiles every forward it sends through
``get_compiled_call`` -- the decode steps, and, with ``prefill_chunk_size``, the prompt chunks too. KVpop's
chunk path (variable candidate sets, FlexAttention, the eviction bookkeeping) runs eagerly inside that call
(graph breaks), and under CUDA graphs (``mode="reduce-overhead"``, transformers' default) that fails: the
eager chunk reads tensors a later graph replay overwrites, and generate stops with "accessing tensor output
of CUDAGraphs that has been overwritten by a subsequent run" (torch 2.11, transformers 5.17). A
``KVpopCache`` therefore refuses a prompt chunk inside a compiled call on CUDA (``KVpopLayer.update``), and
long prompts are fed here instead::

    cache = KVpopCache.from_pretrained(repo, model.config)
    prefill_in_chunks(model, cache, input_ids, chunk_size=16384, attention_mask=attention_mask)
    out = model.generate(input_ids, attention_mask=attention_mask, **with_cache(model, cache, max_new_tokens=256))

``generate`` sees the cache holding all but the last prompt token, forwards that one token eagerly and
decodes with its compiled step (what ``benchmarks/generation_speed.py`` measures). The chunks are fed as
``generate``'s own chunked prefill feeds them (the attention mask up to each chunk's end, position ids
from the mask), so the result equals ``generate(..., prefill_chunk_size=chunk_size)`` run eagerly.

Shapes: ``input_ids [b, n]``, ``attention_mask [b, n]`` (1 = token, 0 = left padding) or None.
"""

from __future__ import annotations

import torch

from .compat import with_cache

__all__ = ["prefill_in_chunks"]


@torch.no_grad()
def prefill_in_chunks(model, cache, input_ids: torch.Tensor, chunk_size: int,
                      attention_mask: torch.Tensor | None = None) -> None:
    """Feed ``input_ids[:, :-1]`` into ``cache`` in chunks of ``chunk_size`` tokens (eager forwards)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, n] with n >= 2 (the last token is left for generate), "
                         f"got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    done = int(cache.get_seq_length())
    if done != 0:
        raise ValueError(f"the cache already holds {done} tokens; prefill_in_chunks fills a new (or reset) cache")
    n = input_ids.shape[1] - 1
    position_ids = None
    if attention_mask is not None:  # as generate derives them: count real tokens, padding at 1
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask[:, :end],
                                                    "position_ids": position_ids[:, start:end]}
        model(input_ids=input_ids[:, start:end], **with_cache(model, cache, use_cache=True, logits_to_keep=1),
              **kwargs)
