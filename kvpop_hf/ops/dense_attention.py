"""Plain (dense) attention pieces shared by the training, testbed and benchmark code.

``expand_kv`` is the GQA key/value expansion (``repeat_interleave`` over heads, which works under autograd on
every backend and in the CPU multi-process tests); ``causal_attention`` is the plain causal fallback that
attention functions registered with transformers use when KVpop has nothing to do. Only depends on torch.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["expand_kv", "causal_attention"]


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, Hkv, ...] -> [b, Hkv * groups, ...]``: query head ``j`` reads KV head ``j // groups``.

    Works on keys/values ``[b, Hkv, S, d]`` and per-KV-head masks or scores ``[b, Hkv, L, S]`` alike;
    ``groups == 1`` returns ``x`` itself."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, scaling: float | None = None,
                     dropout: float = 0.0) -> torch.Tensor:
    """Plain softmax attention in transformers' attention-function layout.

    query ``[b, Hq, L, d]``, key/value ``[b, Hkv, S, d]`` (``Hq`` a multiple of ``Hkv``), attention_mask
    ``[b, 1 or Hq, L, S]`` (bool or additive float) or None for causal (sdpa's ``is_causal``, meant for
    ``L == S``; no mask at all when ``L == 1``) -> ``[b, L, Hq, d]`` contiguous.

    Without a mask the KV heads are shared through sdpa's ``enable_gqa`` (no expanded copy of the keys and values:
    the flash kernel reads them in place, as transformers' own sdpa path does for an unmasked call); with a mask
    they are expanded, since the memory-efficient kernel that masked calls take has no GQA support."""
    groups = query.shape[1] // key.shape[1]
    if attention_mask is None and groups > 1:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, dropout_p=dropout,
                                             is_causal=query.shape[2] > 1, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    out = F.scaled_dot_product_attention(query, expand_kv(key, groups), expand_kv(value, groups),
                                         attn_mask=attention_mask, scale=scaling, dropout_p=dropout,
                                         is_causal=attention_mask is None and query.shape[2] > 1)
    return out.transpose(1, 2).contiguous()
