"""mLSTM memory operations in two forms: the recurrent step and the chunkwise-parallel form.

Memory per (batch, head): matrix ``C`` ``[dk, dv]`` and normaliser ``n`` ``[dk]``.
Absorbing token j: ``C <- f_j C + i_j k_j v_j^T``, ``n <- f_j n + i_j k_j``
(forget gate ``f = sigmoid``, given as ``log f``; input gate ``i`` in [0, 1]).
Reading with a query ``q``: ``h = q^T C / max(|q^T n|, 1)`` (xLSTM, Beck et al., 2024; KVpop Eq. 10).

The chunkwise form reads, after each absorbed token j, with its own query ``q_j`` and must
equal running :func:`mlstm_step` token by token; tests compare the two.
"""

from __future__ import annotations

import torch


def mlstm_step(C, n, k, v, log_f, i_gate, q):
    """One token. C ``[b,h,dk,dv]``, n ``[b,h,dk]``, k/q ``[b,h,dk]``, v ``[b,h,dv]``, log_f/i_gate ``[b,h]``.

    Returns (C, n, h) with h ``[b,h,dv]``.
    """
    f = log_f.exp()
    C = f[..., None, None] * C + i_gate[..., None, None] * k[..., :, None] * v[..., None, :]
    n = f[..., None] * n + i_gate[..., None] * k
    num = (q[..., :, None] * C).sum(-2)  # q^T C (a product and a sum: one fused kernel when compiled)
    den = (q * n).sum(-1).abs().clamp_min(1.0)
    return C, n, num / den[..., None]


def mlstm_chunkwise(C, n, k, v, log_f, i_gate, q, chunk_size: int = 128):
    """Many tokens. k/q ``[b,h,L,dk]``, v ``[b,h,L,dv]``, log_f/i_gate ``[b,h,L]``.

    Processes sub-chunks of ``chunk_size`` tokens: within a sub-chunk the readouts use the
    quadratic (parallel) form, across sub-chunks the memory is carried, so memory is
    O(L * chunk_size). Returns (C, n, h) with h ``[b,h,L,dv]``.
    """
    outs = []
    for start in range(0, k.shape[2], chunk_size):
        sl = slice(start, start + chunk_size)
        C, n, h = _parallel_block(C, n, k[:, :, sl], v[:, :, sl], log_f[:, :, sl], i_gate[:, :, sl], q[:, :, sl])
        outs.append(h)
    if not outs:
        return C, n, q.new_zeros(*q.shape[:3], v.shape[-1])
    return C, n, torch.cat(outs, dim=2)


def _parallel_block(C, n, k, v, log_f, i_gate, q):
    L = k.shape[2]
    cum = log_f.cumsum(-1)  # log of prod_{l<=j} f_l
    # decay[j, i] = i_i * prod_{i<l<=j} f_l for i <= j, else 0
    causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
    log_d = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = log_d.exp() * i_gate[..., None, :]
    scores = torch.einsum("bhjk,bhik->bhji", q, k) * decay
    carry = cum.exp()  # weight of the initial memory at step j
    num = scores @ v + carry[..., None] * torch.einsum("bhjk,bhkv->bhjv", q, C)
    den = scores.sum(-1) + carry * torch.einsum("bhjk,bhk->bhj", q, n)
    h = num / den.abs().clamp_min(1.0)[..., None]
    # memory after the block
    w_end = (cum[..., -1:] - cum).exp() * i_gate  # [b,h,L]
    C = carry[..., -1, None, None] * C + torch.einsum("bhi,bhik,bhiv->bhkv", w_end, k, v)
    n = carry[..., -1, None] * n + torch.einsum("bhi,bhik->bhk", w_end, k)
    return C, n, h
