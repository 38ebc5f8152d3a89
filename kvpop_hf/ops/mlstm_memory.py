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

    All sub-chunks of ``chunk_size`` tokens at once (a fixed number of ops whatever ``L``): within a
    sub-chunk the readouts use the quadratic form; the memory at each sub-chunk's start is the decayed
    sum of the earlier sub-chunks' contributions, ``C_c = e^{A_c} C_0 + sum_{j<c} e^{A_c - A_{j+1}} U_j``
    with ``A_c`` the summed ``log f`` before sub-chunk ``c`` and ``U_j`` what sub-chunk ``j`` writes.
    Memory O(L * chunk_size). Returns (C, n, h) with h ``[b,h,L,dv]``; equals
    :func:`mlstm_chunkwise_sequential` (and so token-by-token :func:`mlstm_step`)."""
    b, H, L, dk = k.shape
    dv = v.shape[-1]
    if L == 0:
        return C, n, q.new_zeros(b, H, 0, dv)
    T = min(chunk_size, L)
    N = -(-L // T)
    pad = N * T - L
    if pad:  # padded tokens: f = 1, i = 0, q = 0 -- they leave the memory alone and are dropped
        k, v, q = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (k, v, q))
        log_f, i_gate = (torch.nn.functional.pad(x, (0, pad)) for x in (log_f, i_gate))
    k, v, q = k.view(b, H, N, T, dk), v.view(b, H, N, T, dv), q.view(b, H, N, T, dk)
    log_f, i_gate = log_f.view(b, H, N, T), i_gate.view(b, H, N, T)
    cum = log_f.cumsum(-1)  # within each sub-chunk
    causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp() * i_gate[..., None, :]
    scores = (q @ k.transpose(-1, -2)) * decay  # [b,H,N,T,T]
    # what each sub-chunk writes, and the memory at each sub-chunk's start
    w_end = (cum[..., -1:] - cum).exp() * i_gate  # [b,H,N,T]
    U = (w_end[..., None] * k).transpose(-1, -2) @ v  # [b,H,N,dk,dv]
    u = (w_end[..., None] * k).sum(-2)  # [b,H,N,dk]
    A = torch.nn.functional.pad(cum[..., -1].cumsum(-1), (1, 0))  # [b,H,N+1]: log decay before sub-chunk c
    c_idx = torch.arange(N + 1, device=k.device)
    earlier = c_idx[:, None] > c_idx[None, :N]  # [N+1, N]: sub-chunk j < c
    W = (A[..., :, None] - A[..., None, 1:]).masked_fill(~earlier, float("-inf")).exp()  # [b,H,N+1,N]
    Cs = W @ U.flatten(-2) + A.exp()[..., None] * C.flatten(-2)[..., None, :]  # [b,H,N+1,dk*dv]
    ns = W @ u + A.exp()[..., None] * n[..., None, :]  # [b,H,N+1,dk]
    C_start, n_start = Cs[..., :N, :].view(b, H, N, dk, dv), ns[..., :N, :]
    carry = cum.exp()  # weight of the sub-chunk's initial memory at step j
    num = scores @ v + carry[..., None] * (q @ C_start)
    den = scores.sum(-1) + carry * (q @ n_start[..., None]).squeeze(-1)
    h = (num / den.abs().clamp_min(1.0)[..., None]).reshape(b, H, N * T, dv)[:, :, :L]
    return Cs[..., N, :].view(b, H, dk, dv), ns[..., N, :], h


def mlstm_chunkwise_sequential(C, n, k, v, log_f, i_gate, q, chunk_size: int = 128):
    """Reference for :func:`mlstm_chunkwise`: the sub-chunks one after another, the memory carried in a
    Python loop (one quadratic block at a time). Same shapes and result."""
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
