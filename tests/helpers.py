"""Tiny random-init models of real architectures (no download) and an independent reference
implementation of the eviction contract (docs/design.md §1), used by the tests."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface

from kvpop_hf.compat import with_cache

from kvpop_lab.tiny_models import VOCAB, distinct_ids, tiny_config, tiny_model  # noqa: F401  (re-exported)


# ---------------------------------------------------------------- independent reference
def reference_priorities(scorer, layer_idx, k, v, window, log_gamma=None, decay_step=64):
    """Static priority of every token of a whole sequence, k/v ``[b, h, S, d]`` -> ``[b, h, S]``, computed
    the slow way, one token at a time (independent of the library's whole-sequence code).

    A stateful scorer absorbs token ``q`` and then reads token ``u = q - w`` (delayed) or ``u = q``
    (immediate); tokens never read get -inf (they never become eligible). A stateless scorer scores
    each token alone. The decay ``floor(t / n) * log_gamma`` is subtracted token by token."""
    b, h, S, _ = k.shape
    r = torch.full((b, h, S), float("-inf"))
    if scorer.stateful:
        state = scorer.init_state(layer_idx, b, k.device)
        delay = window if scorer.delayed else 0
        for q in range(S):
            u = q - delay
            read = slice(max(u, 0), max(u, 0) + 1)
            state, out = scorer.absorb_and_read(layer_idx, state, k[:, :, q:q + 1], v[:, :, q:q + 1], None,
                                                k[:, :, read], v[:, :, read])
            if u >= 0:
                r[:, :, u] = out[:, :, 0].float()
    else:
        for t in range(S):
            pos = torch.full((b, h, 1), t, dtype=torch.long)
            r[:, :, t] = scorer.score(layer_idx, k[:, :, t:t + 1], v[:, :, t:t + 1], pos)[:, :, 0].float()
    if log_gamma is not None:
        for t in range(S):
            r[:, :, t] = r[:, :, t] - (t // decay_step) * log_gamma.float()
    return r


def contract_mask(prio, sinks, window, topk):
    """Brute force R(q): ``[b, h, S, S]`` bool from priorities ``[b, h, S]`` (loops over q)."""
    b, h, S = prio.shape
    mask = torch.zeros(b, h, S, S, dtype=torch.bool)
    for q in range(S):
        mask[:, :, q, : min(sinks, q + 1)] = True
        mask[:, :, q, max(q - window + 1, 0): q + 1] = True
        elig = [u for u in range(sinks, q - window + 1)]
        if not elig or topk == 0:
            continue
        for bi in range(b):
            for hi in range(h):
                best = sorted(elig, key=lambda u: (prio[bi, hi, u].item(), u), reverse=True)[:topk]
                mask[bi, hi, q, best] = True
    return mask


class ReferenceAttention:
    """An attention function for whole sequences (no cache) that applies the contract mask built
    layer by layer from that layer's own keys, values and the scorer."""

    def __init__(self, scorer, sinks, window, topk, log_gamma=None, decay_step=64):
        self.scorer, self.s, self.w, self.k = scorer, sinks, window, topk
        self.log_gamma, self.decay_step = log_gamma, decay_step
        self.masks = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        li = module.layer_idx
        lg = None if self.log_gamma is None else self.log_gamma[li]
        prio = reference_priorities(self.scorer, li, key, value, self.w, lg, self.decay_step)
        mask = contract_mask(prio, self.s, self.w, self.k)
        self.masks[li] = mask
        groups = query.shape[1] // key.shape[1]
        m = mask.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                             value.repeat_interleave(groups, 1), attn_mask=m, scale=scaling)
        return out.transpose(1, 2).contiguous(), None


def reference_logits(model, ids, scorer, sinks, window, topk, log_gamma=None, decay_step=64):
    ref = ReferenceAttention(scorer, sinks, window, topk, log_gamma, decay_step)
    AttentionInterface.register("kvpop_ref", ref)
    AttentionMaskInterface.register("kvpop_ref", lambda *a, **k: None)
    old = model.config._attn_implementation
    model.set_attn_implementation("kvpop_ref")
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
    finally:
        model.set_attn_implementation(old)
    return logits, ref.masks


# ---------------------------------------------------------------- feeding a cache
def run_whole(model, ids, cache):
    with torch.no_grad():
        return model(ids, **with_cache(model, cache)).logits


def run_tokens(model, ids, cache):
    with torch.no_grad():
        return torch.cat([model(ids[:, i:i + 1], **with_cache(model, cache)).logits for i in range(ids.shape[1])], 1)


def run_chunks(model, ids, cache, sizes=(3, 1, 7, 2, 9, 1, 5, 13)):
    """Feed ``ids`` in chunks of the (repeated) mixed ``sizes``."""
    out, i = [], 0
    with torch.no_grad():
        for n in sizes * 10:
            if i >= ids.shape[1]:
                break
            out.append(model(ids[:, i:i + n], **with_cache(model, cache)).logits)
            i += n
    return torch.cat(out, 1)


def left_padded(rows):
    """Stack 1D id tensors into a left-padded batch: (ids, attention_mask, width)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask, width
