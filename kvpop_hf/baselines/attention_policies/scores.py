"""Attention that also returns the scores the dynamic-score policies need (TOVA, H2O, SnapKV).

Called by the ``"scores"`` hand-offs (:mod:`kvpop_hf.handoff`) of :class:`kvpop_hf.baselines.attention_policies.layer.DynamicScoreLayer` (see docs/design.md §7). Each query
``j`` (real position ``q_j``) sees every candidate ``c`` with ``0 <= pos_c <= q_j``: for a decode step
the ``B`` slots (the occupied prefix), for a prompt chunk the stored entries followed by the chunk. Only
this call's query rows are materialised, ``QUERY_BLOCK`` at a time: probabilities ``[b, Hq, l, C]``,
``l = 1`` when decoding.

The policy's votes are ``votes[b, h, c] = sum_j w[b, j] * mean_g P[b, (h, g), j, c]``: the probabilities
averaged over the ``G`` query heads of KV head ``h`` and summed over the queries the policy weights
(``w [b, L]``: the last query for TOVA, all for H2O, the last ``obs_window`` for SnapKV). The hand-off
gets them through ``finish(votes)`` and updates the cache; nothing is kept here.
"""

from __future__ import annotations

import torch

__all__ = ["attend_and_score"]


QUERY_BLOCK = 256  # query rows per block: a chunk's scores take O(QUERY_BLOCK * C) memory per head


def attend_and_score(handoff, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     valid: torch.Tensor | None, scaling: float | None, block: int | None = None) -> torch.Tensor:
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]``, valid ``[b, L]`` bool or None (no padding)
    -> out ``[b, L, Hq, dv]``; calls ``handoff.begin(valid, key, value)`` for ``(cand_pos [b, Hkv, C],
    query_pos [b, L], weights [b, L] or None)`` and ``handoff.finish(votes [b, Hkv, C])`` when weights are
    given. Queries are taken ``block`` (default ``QUERY_BLOCK``) rows at a time (probabilities
    ``[b, Hq, block, C]`` float32)."""
    block = block or QUERY_BLOCK
    b, hq, L, d = query.shape
    hkv, C = key.shape[1], key.shape[2]
    groups = hq // hkv
    cand_pos, query_pos, weights = handoff.begin(valid, key, value)
    # a padding query after real ones attends as the last real query before it (kvpop_hf.layer.attending_positions)
    attend_pos = query_pos.cummax(dim=-1).values
    scale = d ** -0.5 if scaling is None else scaling
    k32, v32 = key.float(), value.float()
    q = query.float().reshape(b, hkv, groups, L, d)
    votes = k32.new_zeros(b, hkv, C) if weights is not None else None
    outs = []
    for j0 in range(0, L, block):
        j1 = min(L, j0 + block)
        logits = torch.einsum("bhgld,bhcd->bhglc", q[:, :, :, j0:j1], k32) * scale  # [b, Hkv, G, l, C]
        qp = attend_pos[:, None, None, j0:j1, None]
        visible = (cand_pos[:, :, None, None, :] >= 0) & (cand_pos[:, :, None, None, :] <= qp)
        # a padding query before any real one sees only its own candidate: no empty rows, output unused
        rows = C - L + torch.arange(j0, j1, device=key.device)
        own = torch.arange(C, device=key.device) == rows[:, None]
        visible = torch.where(qp < 0, own, visible)
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("bhglc,bhcd->bhgld", probs, v32))
        if votes is not None:
            votes += torch.einsum("bhglc,bl->bhc", probs, weights[:, j0:j1].float())
    if votes is not None:
        handoff.finish(votes / groups)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, L, -1).transpose(1, 2).to(query.dtype).contiguous()
