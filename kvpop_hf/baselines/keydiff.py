"""KeyDiff (Park et al., 2025) as a static priority: keep the keys that differ most from the average key.

KeyDiff ranks cached keys by their cosine similarity to an anchor, the mean key, and evicts the most
similar ones: a key that looks like every other key adds little. KVpop's cache needs a priority that is
fixed once read (docs/design.md §1), so the anchor here is the mean of the keys the head has seen when the
token is scored, read with the same delay as the mLSTM scorer: token ``u`` is scored when it leaves the
window at query ``q = u + w``, against the mean of keys ``0..q``:

    r_u = -cos(k_u, (1 / (q + 1)) * sum_{j <= q} k_j)

The state per (batch row, KV head) is the running key sum ``[d]`` (float32); padding is skipped.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..scorers.base import Scorer


class KeyDiffScorer(Scorer):
    """Attention-free, training-free; stateful (a running key sum per head), delayed like KVpop."""

    stateful = True
    delayed = True

    def init_state(self, layer_idx, batch_size, device):
        return (torch.zeros(batch_size, self.num_kv_heads, self.head_dim, device=device),)

    def absorb_and_read(self, layer_idx, state, new_keys, new_values, new_valid, read_keys, read_values):
        (total,) = state
        k = new_keys.float()
        if new_valid is not None:
            k = k * new_valid[:, None, :, None].to(k.dtype)
        running = total[:, :, None, :] + k.cumsum(2)  # key sum after each absorbed token [b,h,n,d]
        # the cosine does not depend on the mean's scale, so the sum serves as the anchor
        scores = -F.cosine_similarity(read_keys.float(), running, dim=-1, eps=1e-12)
        return (running[:, :, -1].contiguous(),), scores
