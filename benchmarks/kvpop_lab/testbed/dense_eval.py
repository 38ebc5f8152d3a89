"""Greedy exact-match evaluation of a causal LM on testbed problems.

:func:`exact_match` generates greedily after each ``problem.prompt`` (batched,
left padding, stopping at ``<eos>``), extracts the answer with
:func:`~kvpop_lab.testbed.tokenizer.extract_answer` and compares it with
``normalize(problem.answer)``. A ``cache_factory`` lets the same loop run with
an eviction cache (a fresh ``past_key_values`` per batch); ``None`` = dense.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from kvpop_hf import KVpopCache
from kvpop_hf.compat import cache_kwarg
from .tasks import Problem
from .tokenizer import count_tokens, extract_answer, normalize

__all__ = ["exact_match"]


def _max_new_tokens(problem: Problem, margin: int = 8) -> int:
    # reference target length (+ <eos>) plus a little slack
    return count_tokens(problem.target) + 1 + margin


def chunking_keeps_sets(cache: Any) -> bool:
    """Whether ``cache`` keeps the same entries however the prompt is chunked (``KVpopCache.prefill_chunks_exact``:
    static-score scorers). Dense caches (None) and caches other than KVpopCache (DMS) count as not."""
    return isinstance(cache, KVpopCache) and cache.prefill_chunks_exact


@torch.no_grad()
def exact_match(model: Any, tokenizer: Any, problems: Sequence[Problem], max_new_tokens: int | None = None,
                batch_size: int = 8, cache_factory: Callable[[], Any] | None = None,
                progress: bool = True, prefill_chunk: int | None = None) -> dict:
    """Greedy exact match per family.

    Returns ``{"em": {family: float, ..., "all": float}, "n": {family: int},
    "outputs": [{"family", "answer", "prediction", "correct", "generated",
    "n_prompt_tokens"}, ...]}`` (``outputs`` in the order of ``problems``).

    ``max_new_tokens=None`` sizes each batch from the longest reference
    target in it (+ 9 tokens). Problems are batched in order of prompt length
    to limit padding.

    ``prefill_chunk``: feed each prompt to generate in chunks of this many tokens when the cache keeps the same
    entries either way (:func:`chunking_keeps_sets`); the generated text is then the one-chunk text, at a fraction
    of the prompt's cost (a KVpop prompt chunk of ``n`` tokens builds an ``n x (kept + n)`` mask per layer).
    Other caches, and ``None`` or ``0``, take the prompt as one chunk.
    """
    if prefill_chunk is not None and prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0 (0 or None: one chunk), got {prefill_chunk}.")
    problems = list(problems)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    old_side = getattr(tokenizer, "padding_side", "left")
    tokenizer.padding_side = "left"
    enc = [tokenizer(p.prompt)["input_ids"] for p in problems]  # <bos> prompt
    order = sorted(range(len(problems)), key=lambda i: len(enc[i]))
    outputs: list[dict | None] = [None] * len(problems)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(problems), desc="dense_eval", leave=False)
    try:
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            L = max(len(enc[i]) for i in idx)
            ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), L), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, L - len(enc[i]):] = torch.tensor(enc[i])
                mask[r, L - len(enc[i]):] = 1
            mnt = max_new_tokens or max(_max_new_tokens(problems[i]) for i in idx)
            kwargs = dict(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=mnt,
                          do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id)
            cache = cache_factory() if cache_factory is not None else None
            if cache is not None:
                kwargs[cache_kwarg(model)] = cache
                if prefill_chunk and chunking_keeps_sets(cache):
                    kwargs["prefill_chunk_size"] = prefill_chunk
            out = model.generate(**kwargs)
            gen = out[:, L:].cpu()
            for r, i in enumerate(idx):
                toks = gen[r].tolist()
                if eos_id in toks:
                    toks = toks[:toks.index(eos_id)]
                text = tokenizer.decode(toks, skip_special_tokens=False)
                pred = extract_answer(text)
                gold = normalize(problems[i].answer)
                outputs[i] = {"family": problems[i].family, "answer": gold, "prediction": pred,
                              "correct": pred == gold, "generated": normalize(text),
                              "n_prompt_tokens": len(enc[i])}
            if bar is not None:
                bar.update(len(idx))
    finally:
        if bar is not None:
            bar.close()
        tokenizer.padding_side = old_side
        model.train(was_training)

    hits: dict[str, list[bool]] = defaultdict(list)
    for o in outputs:
        hits[o["family"]].append(o["correct"])
    em = {f: sum(v) / len(v) for f, v in hits.items()}
    allv = [o["correct"] for o in outputs]
    em["all"] = sum(allv) / len(allv) if allv else float("nan")
    return {"em": em, "n": {f: len(v) for f, v in hits.items()}, "outputs": outputs}
