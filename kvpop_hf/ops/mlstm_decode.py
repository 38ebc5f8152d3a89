"""The mLSTM scorer's work in one decode step, fused: read the scored token, absorb the new one, score, decay.

Per (batch row, KV head), with ``t = seen[row]`` the new token's position (KVpop, arXiv:2607.05061 Eqs. 9-11;
the torch version is :meth:`MLSTMScorer.absorb_and_read` plus :func:`kvpop_hf.ops.priority.decayed_priorities`,
called by ``KVpopLayer.decode_step``):

1. the token read is the one in the new token's ring slot (delayed scoring: it leaves the window now) or the
   new token itself (``delayed=False``);
2. ``x = [k; v]`` of the new token gives ``k~ = x Wk``, ``v~ = x Wv``, ``i = sigmoid(x wi + bi)``,
   ``log f = logsigmoid(x wf + bf)``; the read token gives ``q~ = x_r Wq / sqrt(ds)``;
3. ``C <- f C + i k~ v~^T``, ``n <- f n + i k~`` (in place), ``h = q~^T C / max(|q~^T n|, 1)``;
4. ``r = a^T SiLU(RMSNorm(h)) + b`` (+ ``at^T SiLU(x_r Wt + bt)`` with ``token_readout``) and the priority
   ``p = r - floor(max(pos_r, 0) / n_decay) * log_gamma_h``.

:func:`mlstm_decode_priority_reference` is that torch path written out (the same signature).
One program per (row, KV head) replaces the dozen small kernels (gathers, three projections, gates, state
update, readout, decay) that the compiled torch version launches per layer. Tests compare the two on random
states (``TRITON_INTERPRET=1`` on CPU).

Shapes: keys ``[b, h, B, d]``, values ``[b, h, B, dv]``, pos ``[b, h, B]``, seen ``[b]``, k_new/v_new
``[b, h, 1, d|dv]``, C ``[b, h, ds, ds]`` and n ``[b, h, ds]`` float32; returns the priority ``[b, h, 1]``.
"""

from __future__ import annotations

import math

import torch

from .decode_eviction import read_entry
from .kernels import lazy_kernel, next_pow2
from .priority import decayed_priorities

__all__ = ["mlstm_decode_kernel", "mlstm_decode_priority_reference", "mlstm_decode_priority_triton"]


def mlstm_decode_priority_reference(scorer, layer_idx: int, state, keys, values, pos, seen, k_new, v_new,
                                    sinks: int, window: int, log_gamma: torch.Tensor | None, decay_step: int,
                                    read_new: bool) -> torch.Tensor:
    """The torch path (``MLSTMScorer.absorb_and_read`` + decay), state copied back in place; ``[b, h, 1]``."""
    pos_r, k_r, v_r = read_entry(keys, values, pos, seen, k_new, v_new, sinks, window, read_new)
    new_state, r = scorer.absorb_and_read(layer_idx, state, k_new, v_new, None, k_r, v_r)
    for old, new in zip(state, new_state):
        old.copy_(new)
    return decayed_priorities(r, pos_r.clamp_min(0), log_gamma, decay_step)


@lazy_kernel("mlstm_decode_priority_triton (Backends.mlstm_step='triton')",
             hint="; or choose Backends(mlstm_step='torch') (KVPOP_MLSTM_STEP=torch)")
def mlstm_decode_kernel(triton, tl):
    """The fused mLSTM decode-step kernel, defined on the first call (importing this module does not import
    triton); ImportError naming the fix without triton."""
    global _project, _gate  # module globals: the kernel calls them, and Triton resolves its names there

    @triton.jit
    def _project(xk, xv, w, od, odv, ods, md, mdv, mds, D: tl.constexpr, DV: tl.constexpr, DS: tl.constexpr):
        """``[xk; xv] @ w`` for one head, w ``[D + DV, DS]`` row-major -> ``[BLOCK_DS]``."""
        top = tl.load(w + od[:, None] * DS + ods[None, :], mask=md[:, None] & mds[None, :], other=0.0)
        bot = tl.load(w + (D + odv[:, None]) * DS + ods[None, :], mask=mdv[:, None] & mds[None, :], other=0.0)
        return tl.sum(xk[:, None] * top, axis=0) + tl.sum(xv[:, None] * bot, axis=0)

    @triton.jit
    def _gate(xk, xv, w, od, odv, md, mdv, D: tl.constexpr):
        """``[xk; xv] . w`` for one head, w ``[D + DV]``."""
        top = tl.load(w + od, mask=md, other=0.0)
        bot = tl.load(w + D + odv, mask=mdv, other=0.0)
        return tl.sum(xk * top, axis=0) + tl.sum(xv * bot, axis=0)

    @triton.jit
    def _mlstm_decode(keys, values, pos, seen, k_new, v_new, C, n, wq, wk, wv, wi, wf, bi, bf, a, b,
                      w_tok, b_tok, a_tok, log_gamma, p_out, H, B, decay_step, q_scale,
                      D: tl.constexpr, DV: tl.constexpr, DS: tl.constexpr, S: tl.constexpr,
                      W: tl.constexpr, READ_NEW: tl.constexpr, HAS_DECAY: tl.constexpr, TOKEN: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DS: tl.constexpr):
        row = tl.program_id(0)  # row = batch * H + head
        head = row % H
        t = tl.load(seen + row // H)
        od = tl.arange(0, BLOCK_D)
        odv = tl.arange(0, BLOCK_DV)
        ods = tl.arange(0, BLOCK_DS)
        md, mdv, mds = od < D, odv < DV, ods < DS
        r64 = row.to(tl.int64)
        xk = tl.load(k_new + r64 * D + od, mask=md, other=0.0).to(tl.float32)
        xv = tl.load(v_new + r64 * DV + odv, mask=mdv, other=0.0).to(tl.float32)
        if READ_NEW:
            rk, rv, pos_r = xk, xv, t
        else:
            slot = tl.where(t < S, t, S + (t - S) % W)
            at = r64 * B + slot
            rk = tl.load(keys + at * D + od, mask=md, other=0.0).to(tl.float32)
            rv = tl.load(values + at * DV + odv, mask=mdv, other=0.0).to(tl.float32)
            pos_r = tl.load(pos + at)
        wo = head.to(tl.int64) * (D + DV) * DS  # this head's [D + DV, DS] block of the layer's weights
        kf = _project(xk, xv, wk + wo, od, odv, ods, md, mdv, mds, D, DV, DS)
        vf = _project(xk, xv, wv + wo, od, odv, ods, md, mdv, mds, D, DV, DS)
        qf = _project(rk, rv, wq + wo, od, odv, ods, md, mdv, mds, D, DV, DS) * q_scale
        go = head.to(tl.int64) * (D + DV)
        gi = _gate(xk, xv, wi + go, od, odv, md, mdv, D) + tl.load(bi + head)
        gf = _gate(xk, xv, wf + go, od, odv, md, mdv, D) + tl.load(bf + head)
        i_gate = 1.0 / (1.0 + tl.exp(-gi))
        f = tl.exp(tl.minimum(gf, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(gf))))  # exp(logsigmoid(gf))
        cm = mds[:, None] & mds[None, :]
        c_at = C + r64 * DS * DS + ods[:, None] * DS + ods[None, :]
        c = f * tl.load(c_at, mask=cm, other=0.0) + i_gate * kf[:, None] * vf[None, :]
        tl.store(c_at, c, mask=cm)
        n_at = n + r64 * DS + ods
        nn = f * tl.load(n_at, mask=mds, other=0.0) + i_gate * kf
        tl.store(n_at, nn, mask=mds)
        num = tl.sum(qf[:, None] * c, axis=0)
        den = tl.maximum(tl.abs(tl.sum(qf * nn, axis=0)), 1.0)
        h = num / den
        h = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=0) / DS + 1e-6))
        silu = h / (1.0 + tl.exp(-h))
        r = tl.sum(tl.where(mds, silu * tl.load(a + head.to(tl.int64) * DS + ods, mask=mds, other=0.0), 0.0),
                   axis=0) + tl.load(b + head)
        if TOKEN:  # the read token's own term
            to = head.to(tl.int64) * DS + ods
            tf = _project(rk, rv, w_tok + wo, od, odv, ods, md, mdv, mds, D, DV, DS)
            tf += tl.load(b_tok + to, mask=mds, other=0.0)
            r += tl.sum(tl.where(mds, tf / (1.0 + tl.exp(-tf)) * tl.load(a_tok + to, mask=mds, other=0.0), 0.0), axis=0)
        if HAS_DECAY:
            blocks = (tl.maximum(pos_r, 0) // decay_step).to(tl.float32)
            r = r - blocks * tl.load(log_gamma + head).to(tl.float32)
        tl.store(p_out + row, r)

    return _mlstm_decode


def mlstm_decode_priority_triton(scorer, layer_idx: int, state, keys, values, pos, seen, k_new, v_new,
                                 sinks: int, window: int, log_gamma: torch.Tensor | None, decay_step: int,
                                 read_new: bool) -> torch.Tensor:
    """Priority ``[b, h, 1]`` of the token read this step (see the module docstring); updates ``state`` in place."""
    C, n = state
    b, h, B, d = keys.shape
    dv = values.shape[-1]
    ds = scorer.state_dim
    for name, x in (("keys", keys), ("values", values), ("pos", pos), ("C", C), ("n", n)):
        if not x.is_contiguous():
            raise ValueError(f"mlstm_decode_priority_triton needs a contiguous `{name}` buffer")
    if C.dtype != torch.float32 or n.dtype != torch.float32:
        raise ValueError("mlstm_decode_priority_triton needs the float32 mLSTM state")
    p = torch.empty(b * h, dtype=torch.float32, device=keys.device)
    weights = [getattr(scorer, w)[layer_idx].float().contiguous() for w in ("wq", "wk", "wv", "wi", "wf", "bi",
                                                                            "bf", "a", "b")]
    # a separate placeholder when there is no decay or no token term (unread then): never the output itself, so
    # no two kernel arguments alias a buffer the kernel writes
    gamma = log_gamma.float().contiguous() if log_gamma is not None else torch.empty(1, device=keys.device)
    if scorer.token_readout:
        token = [getattr(scorer, w)[layer_idx].float().contiguous() for w in ("wt", "bt", "at")]
    else:
        token = [torch.empty(1, device=keys.device)] * 3
    mlstm_decode_kernel()[(b * h,)](
        keys, values, pos, seen, k_new.reshape(b, h, d).contiguous(), v_new.reshape(b, h, dv).contiguous(), C, n,
        *weights, *token, gamma, p, h, B, decay_step, 1.0 / math.sqrt(ds),
        D=d, DV=dv, DS=ds, S=sinks, W=window, READ_NEW=read_new, HAS_DECAY=log_gamma is not None,
        TOKEN=scorer.token_readout, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), BLOCK_DS=next_pow2(ds))
    return p.view(b, h, 1)
