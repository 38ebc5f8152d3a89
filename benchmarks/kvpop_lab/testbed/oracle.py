"""Oracle eviction: keep the tokens the dense model's *future* attention will use (an analysis tool, not a
causal policy).

The future-attention oracle of KVpop (arXiv:2607.05061, Sec. 3.2; the training target of the scorers)
needs the whole sequence, so it cannot run inside a real generation. For a problem whose reference
``<bos> prompt target <eos>`` is known, :func:`oracle_table` runs the dense model over it once and keeps,
per layer, the oracle priorities ``r* [Hkv, S]``; :class:`OracleScorer` then serves them by position to a
:class:`~kvpop_hf.KVpopCache`, which evicts exactly as with any static scorer (same running top-k
contract). Under eviction the model's later layers see different keys than the dense pass did, so this
is the dense model's oracle replayed, a reference point for how much of a budget is usable, not a proven
upper bound.
"""

from __future__ import annotations

import torch

from kvpop_hf.ops.dense_attention import expand_kv
from kvpop_hf.scorers.base import Scorer
from kvpop_hf.ops.targets import dense_causal_lse, future_attention_target, reduce_power
from .qkv import record_qkv

__all__ = ["OracleScorer", "check_kind", "oracle_kind_arg", "oracle_table", "oracle_table_from_qkv", "target_queries"]

#: priority of positions the table does not cover (beyond the reference sequence): below every real score
OUTSIDE = -1e9


class OracleScorer(Scorer):
    """Static scorer reading precomputed priorities: ``table [num_layers, kv_heads, S]`` float32;
    ``score(layer, keys, values, positions [b, h, n]) -> table[layer, h, positions]`` (``OUTSIDE`` for
    positions ``< 0`` or ``>= S``)."""

    def __init__(self, table: torch.Tensor):
        if table.dim() != 3:
            raise ValueError(f"OracleScorer needs a [num_layers, kv_heads, S] table, got shape {tuple(table.shape)}")
        L, H, _ = table.shape
        super().__init__(L, H, head_dim=0)
        self.register_buffer("table", table.float(), persistent=False)

    def bind_head_dim(self, head_dim: int) -> "OracleScorer":
        """Set the model's head size (the cache checks the scorer's shape against the model)."""
        self.head_dim = head_dim
        return self

    def score(self, layer_idx, keys, values, positions):
        b, h, n = positions.shape
        S = self.table.shape[-1]
        tab = self.table[layer_idx].to(positions.device)  # [H, S]
        idx = positions.clamp(0, S - 1)
        out = torch.gather(tab.unsqueeze(0).expand(b, -1, -1), 2, idx)
        inside = (positions >= 0) & (positions < S)
        return torch.where(inside, out, torch.full_like(out, OUTSIDE))


@torch.no_grad()
def oracle_table(model, ids: torch.Tensor, window: int, backend: str = "chunked", kind: str = "mean",
                 query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dense pass over ``ids [1, S]`` -> oracle priorities ``[num_layers, kv_heads, S]`` (float32, CPU).

    ``kind="mean"``: the paper's future-attention target, the *mean* attention a key receives from queries at
    least ``window`` tokens later, averaged over the query heads of its KV head (``future_attention_target``).
    ``kind="max"``: the *largest* such attention weight over later queries and over the query heads of the KV
    head (``future_attention_target(..., reduce="max")`` per query head, chunked pass, then the max over the
    group: ``log`` is monotonic), which ranks a token read by a single later query as high as one read by many.
    ``kind="p<x>"`` (e.g. ``"p4"``): the power mean of order ``x > 1`` of those weights, averaged over the
    group as in training (``future_attention_target(..., reduce="p<x>")``), between the two.
    ``query_mask [1, S]`` (bool): only the marked later queries count (e.g. those that generate the answer,
    :func:`target_queries`)."""
    check_kind(kind)
    return oracle_table_from_qkv(record_qkv(model, ids), window, backend, kind, query_mask)


def oracle_table_from_qkv(qkv: dict, window: int, backend: str = "chunked", kind: str = "mean",
                          query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`oracle_table` from an already recorded dense pass (``analysis.record_qkv``)."""
    check_kind(kind)
    rows = []
    for layer in sorted(qkv):
        q, k, _, scale = qkv[layer]
        lse = dense_causal_lse(q, k, scale)
        if kind != "max":
            rows.append(future_attention_target(q, k, lse, window, scale=scale,
                                                backend=backend if kind == "mean" else "chunked", reduce=kind,
                                                query_mask=_on(query_mask, q))[0].cpu())
            continue
        hq, hkv = q.shape[1], k.shape[1]
        per_head = future_attention_target(q, expand_kv(k, hq // hkv), lse, window, scale=scale,
                                           backend="chunked", reduce="max", query_mask=_on(query_mask, q))[0]
        rows.append(per_head.view(hkv, hq // hkv, -1).amax(dim=1).cpu())
    return torch.stack(rows)


def check_kind(kind) -> None:
    """An oracle kind is a ``reduce`` of :func:`future_attention_target`: ``mean``, ``max`` or ``p<x>``."""
    try:
        reduce_power(kind)
    except ValueError:
        raise ValueError(f"oracle kind must be 'mean', 'max' or 'p<x>' with a number x > 1 (e.g. 'p4'), "
                         f"got {kind!r}") from None


def oracle_kind_arg(text: str) -> str:
    """argparse ``type`` of an oracle kind option: the kind, or an argparse error that names the accepted ones."""
    import argparse
    try:
        check_kind(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _on(mask, like):
    return None if mask is None else mask.to(like.device)


def target_queries(labels: torch.Tensor) -> torch.Tensor:
    """``labels [B, S]`` (``-100`` = not scored) -> ``[B, S]`` bool: the queries whose *next* token is scored,
    i.e. those that produce the answer (query ``d`` predicts token ``d + 1``)."""
    mask = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    mask[:, :-1] = labels[:, 1:] != -100
    return mask
