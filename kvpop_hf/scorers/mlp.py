"""Stateless learned scorer: a head-wise two-layer SiLU MLP on ``[k; v]`` (KVpop_mlp, arXiv:2607.05061 Sec. 3.3)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Scorer, check_scorer_option, headwise_linear, scorer_input


class MLPScorer(Scorer):
    """``r_{h,t} = w2_h . SiLU(W1_h [k_t; v_t] + b1_h) + b2_h`` with separate weights per layer and KV head.

    Parameters (per layer l): ``w1[l]`` ``[h, 2d, hidden]``, ``b1[l]`` ``[h, hidden]``,
    ``w2[l]`` ``[h, hidden]``, ``b2[l]`` ``[h]``.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, hidden: int = 64, seed: int = 0):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.hidden = check_scorer_option("mlp", "hidden", hidden, 1)
        gen = torch.Generator().manual_seed(seed)
        d_in = 2 * head_dim
        shape = (num_layers, num_kv_heads)
        self.w1 = nn.Parameter(torch.randn(*shape, d_in, self.hidden, generator=gen) / math.sqrt(d_in))
        self.b1 = nn.Parameter(torch.zeros(*shape, self.hidden))
        self.w2 = nn.Parameter(torch.randn(*shape, self.hidden, generator=gen) / math.sqrt(self.hidden))
        self.b2 = nn.Parameter(torch.zeros(*shape))

    def config_dict(self):
        return {"hidden": self.hidden}

    def score(self, layer_idx, keys, values, positions):
        x = scorer_input(keys, values)
        hid = nn.functional.silu(headwise_linear(x, self.w1[layer_idx].float(), self.b1[layer_idx].float()))
        return (hid * self.w2[layer_idx].float()[None, :, None]).sum(-1) + self.b2[layer_idx].float()[None, :, None]
