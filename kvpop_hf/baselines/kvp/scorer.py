"""KVP agent as a stateless scorer: one small MLP per (layer, KV head) over key, value and position features
(KVP, "Learning to Evict from Key-Value Cache", Apple, ICML 2026, Sec. 4).

For token ``t`` with key ``k_t``, value ``v_t`` (``[d]``) and position ``t``, per layer and KV head ``h``:

    x_t = [ LN(Wk_h k_t + bk_h) ; LN(Wv_h v_t + bv_h) ; LN(E_h[min(t, T - 1)]) ]      (P + P + E features)
    r_t = w3_h . SiLU(W2_h SiLU(W1_h x_t + b1_h) + b2_h) + b3_h

``E_h`` is a learned position table of ``T = max_positions`` rows (later positions share the last row),
``LN`` a layer norm with per-head gain and bias. The score depends on the token alone, so it is a static
priority: the cache's running top-k fast path serves it, and it is trained offline by
:mod:`kvpop_hf.baselines.kvp` (``training/train_kvp.py``). ``trained_with`` records the objective ("rl", or
"supervised" for the ablation) and does not change the computation.
Parameters per layer ``l``: ``wk/wv [h, d, P]``, ``pos [h, T, E]``, ``w1 [h, 2P + E, hidden]``,
``w2 [h, hidden, hidden]``, ``w3 [h, hidden]`` and their biases / layer-norm gains.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ...scorers.base import Scorer, check_scorer_option, headwise_linear

OBJECTIVES = ("rl", "supervised")


class KVPScorer(Scorer):
    """Per-(layer, KV head) MLP agent on (key, value, position); scores ``[b, h, n]`` float32."""

    def __init__(self, num_layers, num_kv_heads, head_dim, proj_dim: int = 32, pos_dim: int = 8,
                 max_positions: int = 2048, hidden: int = 32, trained_with: str = "rl", seed: int = 0):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.proj_dim = check_scorer_option("kvp", "proj_dim", proj_dim, 1)
        self.pos_dim = check_scorer_option("kvp", "pos_dim", pos_dim, 1)
        self.max_positions = check_scorer_option("kvp", "max_positions", max_positions, 1)
        self.hidden = check_scorer_option("kvp", "hidden", hidden, 1)
        if trained_with not in OBJECTIVES:
            raise ValueError(f"Scorer 'kvp': `trained_with` must be one of {OBJECTIVES}, got {trained_with!r}.")
        self.trained_with = trained_with
        gen = torch.Generator().manual_seed(seed)
        L, H, d, P, E, M = num_layers, num_kv_heads, head_dim, self.proj_dim, self.pos_dim, self.hidden

        def weight(*shape):
            return nn.Parameter(torch.randn(L, H, *shape, generator=gen) / math.sqrt(shape[0]))

        self.wk, self.bk = weight(d, P), nn.Parameter(torch.zeros(L, H, P))
        self.wv, self.bv = weight(d, P), nn.Parameter(torch.zeros(L, H, P))
        self.pos = nn.Parameter(torch.randn(L, H, self.max_positions, E, generator=gen))
        self.ln_gain = nn.Parameter(torch.ones(L, H, 2 * P + E))
        self.ln_bias = nn.Parameter(torch.zeros(L, H, 2 * P + E))
        self.w1, self.b1 = weight(2 * P + E, M), nn.Parameter(torch.zeros(L, H, M))
        self.w2, self.b2 = weight(M, M), nn.Parameter(torch.zeros(L, H, M))
        self.w3, self.b3 = nn.Parameter(0.1 * torch.randn(L, H, M, generator=gen) / math.sqrt(M)), \
            nn.Parameter(torch.zeros(L, H))

    def config_dict(self):
        return {"proj_dim": self.proj_dim, "pos_dim": self.pos_dim, "max_positions": self.max_positions,
                "hidden": self.hidden, "trained_with": self.trained_with}

    def score(self, layer_idx, keys, values, positions):
        l, P = layer_idx, self.proj_dim
        fk = F.layer_norm(headwise_linear(keys.float(), self.wk[l].float(), self.bk[l].float()), (P,))
        fv = F.layer_norm(headwise_linear(values.float(), self.wv[l].float(), self.bv[l].float()), (P,))
        heads = torch.arange(positions.shape[1], device=positions.device).view(1, -1, 1)
        fp = F.layer_norm(self.pos[l].float()[heads, positions.long().clamp(0, self.max_positions - 1)],
                          (self.pos_dim,))  # [b, h, n, E]
        x = torch.cat([fk, fv, fp], dim=-1) * self.ln_gain[l].float()[None, :, None] \
            + self.ln_bias[l].float()[None, :, None]
        x = F.silu(headwise_linear(x, self.w1[l].float(), self.b1[l].float()))
        x = F.silu(headwise_linear(x, self.w2[l].float(), self.b2[l].float()))
        return (x * self.w3[l].float()[None, :, None]).sum(-1) + self.b3[l].float()[None, :, None]
