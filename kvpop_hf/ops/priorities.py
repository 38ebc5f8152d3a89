"""Student priorities for whole training sequences, identical to what KVpopCache computes online.

``p_t = r_t - floor(t / n) * log_gamma_h`` (docs/design.md §1). Stateless scorers score every token
from its (k, v). The stateful mLSTM absorbs the sequence in order and reads token ``u`` after
absorbing ``u + w`` (delayed scoring; its parallel readout query at position ``j`` is token
``j - w``), or right after ``u`` itself when ``delayed=False``. Tokens never read (they never leave
the window inside the sequence) get ``-inf``: they are never eligible.
"""

from __future__ import annotations

import torch

from .priority import decayed_priorities


def sequence_priorities(scorer, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, window: int,
                        log_gamma: torch.Tensor | None = None, decay_step: int = 64) -> torch.Tensor:
    """keys/values ``[b, h, S, d]`` (detach them from the backbone first) -> priorities ``[b, h, S]`` float32,
    differentiable with respect to the scorer (and `log_gamma` if it is a parameter)."""
    b, h, S, _ = keys.shape
    pos = torch.arange(S, device=keys.device).view(1, 1, S).expand(b, h, S)
    if scorer.stateful:
        state = scorer.init_state(layer_idx, b, keys.device)
        valid = torch.ones(b, S, dtype=torch.bool, device=keys.device)
        if scorer.delayed:
            src = (torch.arange(S, device=keys.device) - window).clamp_min(0)
            _, read = scorer.absorb_and_read(layer_idx, state, keys, values, valid, keys[:, :, src], values[:, :, src])
            tail = read.new_full((b, h, min(window, S)), float("-inf"))
            r = torch.cat([read[:, :, window:], tail], dim=2)
        else:
            _, r = scorer.absorb_and_read(layer_idx, state, keys, values, valid, keys, values)
    else:
        r = scorer.score(layer_idx, keys, values, pos)
    return decayed_priorities(r, pos, log_gamma, decay_step)
