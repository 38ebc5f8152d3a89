"""Stateful learned scorer: a head-wise mLSTM memory with delayed readout (KVpop, arXiv:2607.05061 Eqs. 9-11).

Every token ``j`` is written into the memory: ``C <- f_j C + i_j k~_j v~_j^T``, ``n <- f_j n + i_j k~_j``.
With delayed scoring, the token ``u = q - w`` that leaves the protected window at query ``q`` is
scored from the memory *after* token ``q`` was absorbed::

    h_{u|q} = q~_u^T C_q / max(|q~_u^T n_q|, 1),     r_u = a^T SiLU(RMSNorm(h_{u|q})) + b

so the scorer sees the ``w`` tokens that followed ``u`` before deciding. ``delayed=False`` reads
immediately after ``u`` itself was absorbed (the paper's ablation, Fig. 5).

Choices not fixed by the paper (documented here): sigmoid input gate (bounded, no stabiliser
needed), log-sigmoid forget gate with bias initialised to ``forget_bias`` (default 3: f ~ 0.95, a memory
half-life of ~14 tokens; with delayed scoring a token's own write has decayed by f^w when it is read, so a
wider window wants a larger bias, e.g. 4.5 for a half-life of ~64 tokens), feature size ``state_dim``, and the
RMSNorm before the SiLU of Eq. 11.

``token_readout=True`` (the default, beyond the paper; ``False`` is the paper's readout alone) adds a term of the read token's own features,
``r_u = a^T SiLU(RMSNorm(h_{u|q})) + at^T SiLU(x_u Wt + bt) + b`` with ``x_u = [k_u; v_u]``: Eq. 11 sees the token
only through its query into the memory, ``h`` being a mix of the memory's values, so a token that is important
for what it is (not for what followed it) has to be recognised through that mix; the term gives the readout the
stateless scorer's view of the token beside the memory's.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .base import Scorer, check_scorer_option, headwise_linear, scorer_input
from ..ops.mlstm_memory import mlstm_chunkwise, mlstm_step


def _headwise_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[b, h, n, i]``, weight ``[h, i]`` -> ``[b, h, n]``."""
    return (x * weight[None, :, None, :]).sum(-1)


class MLSTMScorer(Scorer):
    """Parameters (per layer l, KV head h): ``wq/wk/wv[l]`` ``[h, 2d, state_dim]``, gate weights
    ``wi/wf[l]`` ``[h, 2d]`` with biases ``bi/bf[l]`` ``[h]``, readout ``a[l]`` ``[h, state_dim]``, ``b[l]`` ``[h]``."""

    stateful = True

    def __init__(self, num_layers, num_kv_heads, head_dim, state_dim: int = 32, delayed: bool = True,
                 chunk_size: int = 128, forget_bias: float = 3.0, token_readout: bool = True, seed: int = 0):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.state_dim = check_scorer_option("mlstm", "state_dim", state_dim, 1)
        if not isinstance(delayed, bool):
            raise ValueError(f"Scorer 'mlstm': `delayed` must be True or False, got {delayed!r}.")
        self.delayed = delayed
        self.chunk_size = check_scorer_option("mlstm", "chunk_size", chunk_size, 1)
        if isinstance(forget_bias, bool) or not isinstance(forget_bias, (int, float)) or not math.isfinite(forget_bias):
            raise ValueError(f"Scorer 'mlstm': `forget_bias` (the forget gate's initial bias) must be a finite "
                             f"number, got {forget_bias!r}.")
        self.forget_bias = float(forget_bias)
        if not isinstance(token_readout, bool):
            raise ValueError(f"Scorer 'mlstm': `token_readout` must be True or False, got {token_readout!r}.")
        self.token_readout = token_readout
        gen = torch.Generator().manual_seed(seed)
        d_in = 2 * head_dim
        shape = (num_layers, num_kv_heads)

        def proj(out):
            return nn.Parameter(torch.randn(*shape, d_in, out, generator=gen) / math.sqrt(d_in))

        self.wq, self.wk, self.wv = proj(self.state_dim), proj(self.state_dim), proj(self.state_dim)
        self.wi = nn.Parameter(torch.randn(*shape, d_in, generator=gen) / math.sqrt(d_in))
        self.wf = nn.Parameter(torch.randn(*shape, d_in, generator=gen) / math.sqrt(d_in))
        self.bi = nn.Parameter(torch.zeros(*shape))
        self.bf = nn.Parameter(torch.full(shape, self.forget_bias))
        self.a = nn.Parameter(torch.randn(*shape, self.state_dim, generator=gen) / math.sqrt(self.state_dim))
        self.b = nn.Parameter(torch.zeros(*shape))
        if token_readout:  # the read token's own term: wt [h, 2d, ds], bt [h, ds], at [h, ds] per layer
            self.wt = proj(self.state_dim)
            self.bt = nn.Parameter(torch.zeros(*shape, self.state_dim))
            self.at = nn.Parameter(torch.randn(*shape, self.state_dim, generator=gen) / math.sqrt(self.state_dim))

    def config_dict(self):
        return {"state_dim": self.state_dim, "delayed": self.delayed, "chunk_size": self.chunk_size,
                "forget_bias": self.forget_bias, "token_readout": self.token_readout}

    # -- pieces ------------------------------------------------------------------------------
    def write_features(self, layer_idx, keys, values, valid=None):
        """k~ ``[b,h,n,ds]``, v~ ``[b,h,n,ds]``, log f ``[b,h,n]``, i ``[b,h,n]`` (padding: f=1, i=0)."""
        x = scorer_input(keys, values)
        k = headwise_linear(x, self.wk[layer_idx].float())
        v = headwise_linear(x, self.wv[layer_idx].float())
        log_f = F.logsigmoid(_headwise_dot(x, self.wf[layer_idx].float()) + self.bf[layer_idx].float()[None, :, None])
        i_gate = torch.sigmoid(_headwise_dot(x, self.wi[layer_idx].float()) + self.bi[layer_idx].float()[None, :, None])
        if valid is not None:
            valid = valid[:, None, :].expand_as(log_f)
            log_f = torch.where(valid, log_f, torch.zeros_like(log_f))
            i_gate = torch.where(valid, i_gate, torch.zeros_like(i_gate))
        return k, v, log_f, i_gate

    def read_features(self, layer_idx, keys, values):
        """q~ ``[b,h,n,ds]`` (scaled by ds^-1/2)."""
        x = scorer_input(keys, values)
        return headwise_linear(x, self.wq[layer_idx].float()) / math.sqrt(self.state_dim)

    def readout(self, layer_idx, h, read_keys, read_values):
        """``r = a^T SiLU(RMSNorm(h)) + b`` (+ ``at^T SiLU(x_u Wt + bt)`` of the read tokens ``[b,h,n,d]`` with
        ``token_readout``); h ``[b,h,n,ds]`` -> ``[b,h,n]``."""
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        r = _headwise_dot(F.silu(h), self.a[layer_idx].float()) + self.b[layer_idx].float()[None, :, None]
        if self.token_readout:
            x = scorer_input(read_keys, read_values)
            t = F.silu(headwise_linear(x, self.wt[layer_idx].float(), self.bt[layer_idx].float()))
            r = r + _headwise_dot(t, self.at[layer_idx].float())
        return r

    # -- Scorer interface --------------------------------------------------------------------
    def decode_kernel(self, device):
        """The fused Triton step; a layer runs it where its ``Backends.mlstm_step`` is ``"triton"`` (the CUDA
        default, docs/backends.md), else the torch path (``absorb_and_read``), which is its reference. The kernel is
        defined now (triton imported), outside any compiled decode step."""
        from ..ops.mlstm_decode import mlstm_decode_kernel, mlstm_decode_priority_triton

        mlstm_decode_kernel()
        return mlstm_decode_priority_triton

    def init_state(self, layer_idx, batch_size, device):
        C = torch.zeros(batch_size, self.num_kv_heads, self.state_dim, self.state_dim, device=device)
        n = torch.zeros(batch_size, self.num_kv_heads, self.state_dim, device=device)
        return (C, n)

    def absorb_and_read(self, layer_idx, state, new_keys, new_values, new_valid, read_keys, read_values):
        k, v, log_f, i_gate = self.write_features(layer_idx, new_keys, new_values, new_valid)
        q = self.read_features(layer_idx, read_keys, read_values)
        C, n = state
        if k.shape[2] == 1:
            C, n, h = mlstm_step(C, n, k[:, :, 0], v[:, :, 0], log_f[:, :, 0], i_gate[:, :, 0], q[:, :, 0])
            h = h[:, :, None]
        else:
            # all sub-chunks at once: a fixed number of ops per call, O(L * chunk_size) memory
            C, n, h = mlstm_chunkwise(C, n, k, v, log_f, i_gate, q, self.chunk_size)
        return (C, n), self.readout(layer_idx, h, read_keys, read_values)
