"""The highest oracle top-k recall that any causal eviction policy can reach (a ceiling for KVpop
arXiv:2607.05061, Fig. 7's metric).

A causal policy decides at query ``q`` from the tokens ``0..q`` alone (a static scorer, the delayed mLSTM
scorer, every heuristic of this package). The future-attention oracle does not: it ranks a token by the
attention it will get from queries that come later, e.g. the ones that answer a question asked at the end.
Take ``m`` *twins* -- sequences equal up to position ``shared`` (the same context, a different question:
:func:`kvpop_lab.testbed.tasks.reasoning_twin`). At a query ``q < shared`` the policy keeps one set ``K`` of
``k`` tokens for all twins, while twin ``i``'s oracle keeps ``O_i``. Then

    mean_i |K & O_i| / k  <=  (1 / (m k)) * (sum of the k largest c_t),   c_t = #{i : t in O_i}

(pick the ``k`` tokens that most oracles keep). With two twins this is ``(1 + |O_1 & O_2| / k) / 2``. At
``q >= shared`` the policy may know the question; there the bound is 1. Averaged over the queries the recall
counts (:func:`kvpop_lab.testbed.analysis.oracle_topk_recall`: every query where eviction happens), it bounds
the twins' mean oracle top-k recall for every causal policy, learned or not.

:func:`causal_recall_bound` computes the bound; :func:`twin_recall_rows` runs both the bound and given scorers'
recall on the twins of testbed problems.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from kvpop_hf.backends import Backends
from kvpop_hf.ops.running_topk import running_topk

__all__ = ["causal_recall_bound", "shared_prefix", "twin_recall_rows"]


def _check(oracles: torch.Tensor, sinks: int, window: int, topk: int, shared: int) -> None:
    if oracles.dim() != 3 or oracles.shape[0] < 1:
        raise ValueError(f"oracles must be [twins, H, S] with at least one twin, got shape {tuple(oracles.shape)}")
    if topk < 1 or window < 1 or sinks < 0:
        raise ValueError(f"need topk >= 1, window >= 1, sinks >= 0; got topk={topk}, window={window}, sinks={sinks}")
    if not 0 <= shared <= oracles.shape[-1]:
        raise ValueError(f"shared must be in [0, S={oracles.shape[-1]}], got {shared}")


def causal_recall_bound(oracles: torch.Tensor, sinks: int, window: int, topk: int, shared: int,
                        chunk: int = 256) -> torch.Tensor:
    """``oracles [m, H, S]`` (the oracle priorities of ``m`` twins, equal up to position ``shared``) -> the bound
    per head ``[H]``: mean over the queries where eviction happens of the best twin-mean recall a single kept
    set reaches (1 at queries ``>= shared``). NaN for a head where eviction never happens."""
    _check(oracles, sinks, window, topk, shared)
    m, H, S = oracles.shape
    ro = running_topk(oracles.float(), sinks, window, topk)  # all twins in one call: rank/cutoff [m, H, S]
    t = torch.arange(S, device=oracles.device)
    total = torch.zeros(H, dtype=torch.float64, device=oracles.device)
    count = 0
    for q0 in range(0, S, chunk):
        q = torch.arange(q0, min(S, q0 + chunk), device=oracles.device)
        elig = (t[None, :] >= sinks) & (t[None, :] <= q[:, None] - window)  # [c, S]
        active = elig.sum(-1) > topk  # [c]
        if not bool(active.any()):
            continue
        c = (elig & (ro.rank[:, :, None, :] <= ro.cutoff[:, :, q, None])).sum(0)  # [H, c, S]: oracles keeping t
        # the k largest counts, greedily from m down: n_j tokens are kept by exactly j oracles
        left = torch.full((H, len(q)), topk, dtype=torch.int64, device=oracles.device)
        best = torch.zeros(H, len(q), dtype=torch.int64, device=oracles.device)
        for j in range(m, 0, -1):
            take = torch.minimum(left, (c == j).sum(-1))
            best += take * j
            left -= take
        val = best.double() / (m * topk)
        val = torch.where((q < shared)[None, :], val, torch.ones_like(val))
        total += torch.where(active[None, :], val, torch.zeros_like(val)).sum(-1)
        count += int(active.sum())
    if count == 0:
        return torch.full((H,), float("nan"), dtype=torch.float64)
    return (total / count).cpu()


def shared_prefix(ids: Sequence[Sequence[int]]) -> int:
    """The number of leading positions at which all the token sequences ``ids`` agree."""
    n = min(len(x) for x in ids)
    for i in range(n):
        if len({x[i] for x in ids}) > 1:
            return i
    return n


@torch.no_grad()
def twin_recall_rows(model, tokenizer, problems: Sequence, twins: int, scored: Sequence[tuple], kinds: Sequence[str],
                     queries: str = "target", seed: int = 0, progress: bool = True) -> list[dict]:
    """Per (oracle kind, policy, budget, layer, KV head): the causal bound (policy ``"causal_bound"``) and each
    scored policy's oracle top-k recall, both over the same ``twins`` sequences of every problem (the problem
    and ``twins - 1`` :func:`~kvpop_lab.testbed.tasks.reasoning_twin` s), averaged over problems.

    ``scored``: ``(policy, budget, cache)`` or ``(policy, budget, cache, own_model)`` as in
    :func:`kvpop_lab.testbed.analysis.oracle_recall_rows`; each budget in them also gets the bound. ``kinds``:
    oracle kinds (``"max"``, ``"mean"``, ``"p<x>"``); ``queries``: ``"target"`` (the queries that produce the
    answer) or ``"all"``."""
    from .analysis import cache_priorities, oracle_recall_shares, record_qkv, record_students
    from .oracle import check_kind, oracle_table_from_qkv, target_queries
    from .tasks import reasoning_twin, training_example

    if twins < 2:
        raise ValueError(f"twins must be >= 2 (the problem and at least one twin), got {twins}")
    if queries not in ("all", "target"):
        raise ValueError(f"queries must be 'all' or 'target', got {queries!r}")
    for kind in kinds:
        check_kind(kind)
    device = next(model.parameters()).device
    backend = Backends.defaults(device, ("target_pass",)).target_pass
    scored = [tuple(s) + (None,) * (4 - len(s)) for s in scored]
    budgets = {}
    for policy, budget, cache, own in scored:
        cfg = cache.kvpop_config
        budgets.setdefault((budget.B, round(budget.cr, 4)), (cfg.sinks, cfg.window, cfg.topk))
    acc: dict[tuple, list[torch.Tensor]] = {}
    it = problems
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(problems, desc="twin recall", leave=False)
    for pi, p in enumerate(it):
        rng = random.Random(f"twins:{seed}:{pi}")
        family = [p] + [reasoning_twin(p, rng.getrandbits(48)) for _ in range(twins - 1)]
        exs = [training_example(x, tokenizer) for x in family]
        shared = shared_prefix([e["input_ids"] for e in exs])
        tables: dict[tuple, torch.Tensor] = {}  # (kind, window) -> [twins, L, H, S]
        prios: dict[tuple, list[torch.Tensor]] = {}  # (policy, budget, layer) -> [twins x [H, S]]
        for ex in exs:
            ids = torch.tensor([ex["input_ids"]], device=device)
            qmask = target_queries(torch.tensor([ex["labels"]], device=device)) if queries == "target" else None
            qkv = record_qkv(model, ids)
            for kind in kinds:
                for window in {w for _, w, _ in budgets.values()}:
                    tables.setdefault((kind, window), []).append(
                        oracle_table_from_qkv(qkv, window, backend=backend, kind=kind, query_mask=qmask).to(device))
            own_qkv = record_students(scored, ids)
            for policy, budget, cache, own in scored:
                if cache.scorer.dynamic:
                    continue  # attention-based policies have no static priority
                for layer in sorted(qkv):
                    prio = cache_priorities(cache, layer, qkv if own is None else own_qkv[id(own)], device)
                    prios.setdefault((policy, budget.B, round(budget.cr, 4), layer), []).append(prio)
        for (kind, window), per_twin in tables.items():
            stack = torch.stack(per_twin)  # [twins, L, H, S]
            for (B, cr), (sinks, w, topk) in budgets.items():
                if w != window:
                    continue
                for layer in range(stack.shape[1]):
                    bound = causal_recall_bound(stack[:, layer], sinks, w, topk, shared)
                    acc.setdefault((kind, "causal_bound", B, cr, layer), []).append(bound)
            for (policy, B, cr, layer), ps in prios.items():
                sinks, w, topk = budgets[(B, cr)]
                if w != window:
                    continue
                rec = torch.stack([oracle_recall_shares(ps[i], stack[i, layer], sinks, w, topk, [(topk, False)])[0]
                                   for i in range(len(ps))]).nanmean(0)
                acc.setdefault((kind, policy, B, cr, layer), []).append(rec.cpu())
    rows = []
    for (kind, policy, B, cr, layer), vals in acc.items():
        r = torch.stack(vals).nanmean(0)
        for h in range(r.shape[0]):
            rows.append({"oracle": kind, "policy": policy, "budget": B, "cr": cr, "layer": layer, "head": h,
                         "recall": r[h].item(), "n_problems": len(vals), "twins": twins})
    return rows
