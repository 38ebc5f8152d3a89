"""Q/K/V traces recorded once from a model, so that KVP trains without running the model (KVP, ICML 2026,
Sec. 6: pre-computed generation traces; only Q/K/V are kept, attention is recomputed when needed).

A trace is a dict: ``q [L, Hq, S, D]``, ``k`` and ``v [L, Hkv, S, D]`` (post-RoPE, stored in ``dtype``),
``scale`` (float), ``family`` and ``seed`` of the testbed problem it came from.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from .analysis import record_qkv
from .tasks import make_problem, training_example


@torch.no_grad()
def record_trace(model, ids: torch.Tensor, dtype: torch.dtype = torch.float16) -> dict:
    """Dense pass over ``ids [1, S]`` -> a trace (tensors on the CPU)."""
    qkv = record_qkv(model, ids)
    layers = sorted(qkv)
    stack = lambda i: torch.stack([qkv[l][i][0] for l in layers]).to("cpu", dtype)  # noqa: E731
    return {"q": stack(0), "k": stack(1), "v": stack(2), "scale": qkv[layers[0]][3]}


@torch.no_grad()
def testbed_traces(model, tokenizer, families: Sequence[str], length: int, n: int, seed: int,
                   dtype: torch.dtype = torch.float16, progress: bool = True,
                   knobs: dict[str, dict] | None = None) -> list[dict]:
    """``n`` traces of ``<bos> prompt target <eos>`` for seeded testbed problems of about ``length`` tokens,
    families taken in turn; ``knobs``: generator knobs per family (``{"reasoning": {"n_facts": 10}}``)."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    it = range(n)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="record traces", leave=False)
    out = []
    for i in it:
        family, pseed = families[i % len(families)], rng.randrange(1 << 30)
        problem = make_problem(family, length=length, seed=pseed, **(knobs or {}).get(family, {}))
        ids = training_example(problem, tokenizer)["input_ids"]
        trace = record_trace(model, torch.tensor([ids], device=device), dtype)
        trace.update(family=family, seed=pseed)
        out.append(trace)
    return out
