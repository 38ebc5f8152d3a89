"""Plain-loop references the tests compare the library's vectorised functions with (none of them is used by
the library or the benchmarks, so they live here rather than in the package)."""

import torch


def soft_eviction_bias_reference(log_keep: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """``kvpop_hf.baselines.dms.mask.soft_eviction_bias``, one entry at a time."""
    b, h, S = log_keep.shape
    out = torch.empty(b, h, S, S, dtype=log_keep.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(S):
                for j in range(S):
                    if j > i:
                        out[bi, hi, i, j] = float("-inf")
                    elif j >= sinks and i - j >= window:
                        out[bi, hi, i, j] = log_keep[bi, hi, j]
                    else:
                        out[bi, hi, i, j] = 0.0
    return out


def hard_visibility_reference(query_pos, key_pos, evict, sinks: int, window: int) -> torch.Tensor:
    """``kvpop_hf.baselines.dms.mask.hard_visibility``, one entry at a time."""
    b, L = query_pos.shape
    h, C = key_pos.shape[1:]
    out = torch.zeros(b, h, L, C, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for li in range(L):
                q = int(query_pos[bi, li])
                for c in range(C):
                    p = int(key_pos[bi, hi, c])
                    if q < 0 or p < 0 or p > q:
                        continue
                    out[bi, hi, li, c] = p < sinks or q - p < window or not bool(evict[bi, hi, c])
    return out


def pl_log_prob_reference(scores: torch.Tensor, perm: torch.Tensor) -> float:
    """``kvpop_hf.baselines.kvp.ranking.pl_log_prob`` of one permutation ``perm [n]`` of ``scores [n]``, picked item by
    item (the sequential definition)."""
    left = list(range(scores.shape[0]))
    total = 0.0
    for item in perm.tolist():
        total += float(scores[item] - torch.logsumexp(scores[left], 0))
        left.remove(item)
    return total


def future_attention_reference(q: torch.Tensor, k: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """``kvpop_hf.baselines.kvp.reward.future_attention``, one future query at a time (loops)."""
    Hq, S, _ = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    u = torch.zeros(Hkv, n, dtype=torch.float64)
    for h in range(Hkv):
        for j in range(n, S):
            rows = [torch.softmax(scale * k[h, : j + 1].double() @ q[h * G + g, j].double(), 0)[:n] for g in range(G)]
            u[h] += torch.stack(rows).amax(0)
    return u.float()


def auc_cost_reference(u: torch.Tensor, perm: torch.Tensor) -> float:
    """``kvpop_hf.baselines.kvp.reward.auc_cost`` as ``sum_{b=0}^{n-1} C_b``, the evicted future attention summed
    over every budget (loops; ``u``, ``perm`` ``[n]``)."""
    n = perm.shape[0]
    return float(sum(u[perm[b:]].double().sum() for b in range(n)))


def causal_recall_bound_reference(oracles: torch.Tensor, sinks: int, window: int, topk: int,
                                  shared: int) -> torch.Tensor:
    """``kvpop_lab.testbed.recall_bound.causal_recall_bound`` by a loop over heads and queries, with the oracle's kept sets found by
    sorting each eligible set (newer token first on ties, the running top-k's order) and the best kept set by
    sorting the tokens by how many oracles keep them (valid inputs only: the vectorised form checks them)."""
    m, H, S = oracles.shape
    out = []
    for h in range(H):
        vals = []
        for q in range(S):
            elig = list(range(sinks, q - window + 1))
            if len(elig) <= topk:
                continue
            if q >= shared:
                vals.append(1.0)
                continue
            kept = [set(sorted(elig, key=lambda t: (-float(oracles[i, h, t]), -t))[:topk]) for i in range(m)]
            counts = sorted((sum(t in k for k in kept) for t in elig), reverse=True)
            vals.append(sum(counts[:topk]) / (m * topk))
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return torch.tensor(out, dtype=torch.float64)
