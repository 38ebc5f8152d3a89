"""KVP's per-head metric: the normalised future-attention AUC cost ``C(sigma) / C(sigma*)`` (1 = the oracle
ordering, larger is worse; KVP, ICML 2026, Sec. 5) of any static-priority policy on held-out traces.

A policy is a :class:`~kvpop_hf.scorers.Scorer` (heuristic or learned). At context length ``n`` of a trace
its ordering ``sigma`` sorts tokens ``0..n-1`` by the priority the cache would give them
(:func:`~kvpop_hf.ops.priorities.sequence_priorities` on the prefix; a delayed stateful scorer has not
read its last ``window`` tokens yet, they rank last). With ``protect=(sinks, window)`` the tokens every
KVpopCache keeps (first ``sinks``, last ``window``) rank first, as in the cache; ``None`` is the paper's
pure ranking. ``u`` is the future attention of :func:`~kvpop_hf.baselines.kvp.reward.future_attention`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

import torch

from ...ops.priorities import sequence_priorities
from .reward import EPS, future_attention, normalized_auc_cost

FRACTIONS = (0.25, 0.5, 0.75)


def eval_points(traces: Sequence[dict], fractions: Sequence[float] = FRACTIONS) -> list[tuple[int, int, torch.Tensor]]:
    """``(trace index, n, u [L, Hkv, n])`` for context lengths ``n = round(f * S)`` of every trace."""
    out = []
    for i, tr in enumerate(traces):
        S = tr["k"].shape[2]
        for f in fractions:
            n = min(S - 1, max(1, round(f * S)))
            u = torch.stack([future_attention(tr["q"][l], tr["k"][l], n, tr["scale"]) for l in range(tr["k"].shape[0])])
            out.append((i, n, u))
    return out


def ordering(priority: torch.Tensor, protect: tuple[int, int] | None = None) -> torch.Tensor:
    """priority ``[..., n]`` -> ``sigma [..., n]`` (most worth keeping first; ties keep position order)."""
    p = priority.float().clone()
    if protect is not None:
        sinks, window = protect
        n = p.shape[-1]
        p[..., :sinks] = float("inf")
        p[..., max(0, n - window):] = float("inf")
    return torch.sort(p, dim=-1, descending=True, stable=True).indices


def evicted_fraction(u: torch.Tensor, perm: torch.Tensor, budget: int) -> torch.Tensor:
    """Share of the future attention on the tokens a single budget evicts, ``C_b / sum(u)`` with ``b = budget``
    (the paper's per-budget cost, normalised by the total): u, perm ``[..., n]`` -> ``[...]``."""
    kept = torch.gather(u.float().expand(perm.shape), -1, perm[..., :budget]).sum(-1)
    total = u.float().sum(-1)
    return (total - kept) / total.clamp_min(EPS)


@torch.no_grad()
def auc_cost_per_head(scorer, traces: Sequence[dict], points, window: int, protect: tuple[int, int] | None = None,
                      log_gamma: torch.Tensor | None = None, decay_step: int = 64, budget: int | None = None
                      ) -> torch.Tensor:
    """Mean over ``points`` (:func:`eval_points`) of the normalised AUC cost -> ``[L, Hkv]`` float32; with
    ``budget``, of :func:`evicted_fraction` at that budget instead."""
    total = None
    for i, n, u in points:
        tr = traces[i]
        costs = []
        for l in range(tr["k"].shape[0]):
            k, v = tr["k"][l, None, :, :n].float(), tr["v"][l, None, :, :n].float()
            lg = log_gamma[l] if log_gamma is not None else None
            prio = sequence_priorities(scorer, l, k, v, window, lg, decay_step)[0]  # [Hkv, n]
            perm = ordering(prio, protect)
            costs.append(normalized_auc_cost(u[l], perm) if budget is None else evicted_fraction(u[l], perm, budget))
        c = torch.stack(costs)
        total = c if total is None else total + c
    return total / len(points)


def cost_table(costs: dict[str, torch.Tensor], what: str = "AUC cost") -> str:
    """``{policy: [L, Hkv] costs}`` -> markdown (mean / min / max over heads)."""
    lines = [f"| policy | mean {what} | best head | worst head |", "|---|---|---|---|"]
    for name, c in costs.items():
        lines.append(f"| {name} | {c.mean():.4f} | {c.min():.4f} | {c.max():.4f} |")
    return "\n".join(lines)


def write_cost_csv(tables: dict[str, dict[str, torch.Tensor]], path: str | Path, column: str = "auc_cost") -> None:
    """``{ranking: {policy: [L, Hkv] costs}}`` -> one CSV row per (ranking, policy, layer, head)."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["ranking", "policy", "layer", "head", column])
        for ranking, costs in tables.items():
            for name, c in costs.items():
                for l in range(c.shape[0]):
                    for h in range(c.shape[1]):
                        w.writerow([ranking, name, l, h, f"{c[l, h]:.6f}"])
