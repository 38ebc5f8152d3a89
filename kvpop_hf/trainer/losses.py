"""Training losses for KVpop.

Boundary (pairwise ranking) loss — KVpop paper eq. 7
----------------------------------------------------
At each query position ``q`` of head ``h`` the eviction policy faces one
decision at the cache boundary: keep the newcomer token ``t_new`` (and evict
the boundary token ``t_bnd``), or drop the newcomer.  The teacher decides
``y = +1`` (keep newcomer) or ``y = -1`` (drop).  With student priorities
``p`` the loss is::

    L = (1 / |V|) * sum_{(b,h,q) in V} omega_{b,h,q} *
        softplus( -y_{b,h,q} * (p[b,h,t_new] - p[b,h,t_bnd]) / temperature )

where ``V`` is the set of valid terms (``t_bnd >= 0``, ``t_new >= 0`` and the
optional ``valid`` mask).  ``omega`` defaults to 1.  The weight helpers below
return weights normalised to mean 1 over ``V`` so they change the *relative*
emphasis of terms but not the overall loss scale.

Distillation loss
-----------------
``KL(teacher || student)`` per token on temperature-softened distributions,
times ``T^2`` (Hinton et al.), averaged over unmasked tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "boundary_loss",
    "margin_weights",
    "balance_weights",
    "distillation_loss",
]


def _check_bhs(name: str, x: torch.Tensor, shape) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _valid_mask(t_new: torch.Tensor, t_bnd: torch.Tensor, S: int,
                valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Terms with a boundary (t_bnd >= 0), a newcomer (t_new >= 0), both in range,
    and (optionally) ``valid`` set."""
    v = (t_bnd >= 0) & (t_new >= 0) & (t_bnd < S) & (t_new < S)
    if valid is not None:
        v = v & valid.to(torch.bool)
    return v


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B,H,S], idx [B,H,Q] (may contain -1) -> x[b,h,idx] with idx clamped."""
    return torch.gather(x, -1, idx.clamp(min=0, max=x.shape[-1] - 1))


def _check_pair_inputs(prio, t_new, t_bnd, keep_new=None, valid=None):
    if not isinstance(prio, torch.Tensor) or prio.dim() != 3:
        raise ValueError("priorities must be a [B, H, S] tensor")
    if not isinstance(t_new, torch.Tensor) or t_new.dim() != 3 or t_new.shape[:2] != prio.shape[:2]:
        raise ValueError(f"t_new must be [B, H, Q] matching prio's [B, H], got "
                         f"{tuple(t_new.shape) if isinstance(t_new, torch.Tensor) else type(t_new)}")
    _check_bhs("t_bnd", t_bnd, t_new.shape)
    if t_new.dtype not in (torch.int64, torch.int32) or t_bnd.dtype not in (torch.int64, torch.int32):
        raise ValueError("t_new and t_bnd must be integer (long) index tensors")
    if keep_new is not None:
        _check_bhs("keep_new", keep_new, t_new.shape)
    if valid is not None:
        _check_bhs("valid", valid, t_new.shape)


def boundary_loss(prio: torch.Tensor, t_new: torch.Tensor, t_bnd: torch.Tensor,
                  keep_new: torch.Tensor, temperature: float = 1.0,
                  omega: Optional[torch.Tensor] = None,
                  valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pairwise boundary loss (KVpop eq. 7), see module docstring.

    Args:
        prio: ``[B, H, S]`` student priorities (differentiable).
        t_new, t_bnd: ``[B, H, Q]`` long token indices per query position
            (normally ``Q == S``); ``t_bnd == -1`` means no boundary decision at
            that position => no loss term.
        keep_new: ``[B, H, Q]`` bool, teacher keeps the newcomer (``y=+1``) or not (``y=-1``).
        temperature: temperature on the priority difference (> 0).
        omega: optional ``[B, H, Q]`` non-negative per-term weights.
        valid: optional ``[B, H, Q]`` bool mask of terms to include.

    Returns:
        scalar ``mean_{valid} omega * softplus(-y (p_new - p_bnd) / temperature)``;
        ``0`` (still attached to ``prio``'s graph) if there is no valid term.
    """
    _check_pair_inputs(prio, t_new, t_bnd, keep_new, valid)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if omega is not None:
        _check_bhs("omega", omega, t_new.shape)
    t_new = t_new.long()
    t_bnd = t_bnd.long()
    v = _valid_mask(t_new, t_bnd, prio.shape[-1], valid)
    n = v.sum()
    if int(n) == 0:
        return prio.sum() * 0.0
    p = prio.float()
    diff = _gather(p, t_new) - _gather(p, t_bnd)
    diff = torch.where(v, diff, torch.zeros_like(diff))  # keep invalid slots finite (NaN-safe grads)
    y = keep_new.to(torch.bool).float() * 2.0 - 1.0
    term = F.softplus(-y * diff / temperature)
    if omega is not None:
        term = term * omega.float()
    term = torch.where(v, term, torch.zeros_like(term))
    return term.sum() / n.float()


def margin_weights(teacher_prio: torch.Tensor, t_new: torch.Tensor, t_bnd: torch.Tensor,
                   valid: Optional[torch.Tensor] = None, scale: float = 1.0,
                   mode: str = "confident", floor: float = 0.0) -> torch.Tensor:
    """Per-term weights from the teacher margin ``delta = |r[t_new] - r[t_bnd]|``.

    ``teacher_prio`` is the teacher's priority/target ``r`` ``[B, H, S]`` (e.g.
    the log future-attention target).  Two choices:

    * ``mode="confident"`` (default): ``w = floor + (1 - floor) * (1 - exp(-delta / scale))``.
      Near-ties (``delta ~ 0``) are down-weighted: their label is decided by
      noise in the target and either decision costs almost nothing; clear
      decisions get weight -> 1.
    * ``mode="ambiguous"``: ``w = floor + (1 - floor) * exp(-delta / scale)``.
      Emphasises the hard, close-call decisions near the boundary (the
      complement of the above).

    Weights are zero on invalid terms, detached, and rescaled to mean 1 over
    the valid terms (all-zero weights fall back to 1).  Returns ``[B, H, Q]`` float32.
    """
    _check_pair_inputs(teacher_prio, t_new, t_bnd, None, valid)
    if mode not in ("confident", "ambiguous"):
        raise ValueError(f"mode must be 'confident' or 'ambiguous', got {mode!r}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")
    t_new = t_new.long()
    t_bnd = t_bnd.long()
    with torch.no_grad():
        r = teacher_prio.detach().float()
        v = _valid_mask(t_new, t_bnd, r.shape[-1], valid)
        delta = (_gather(r, t_new) - _gather(r, t_bnd)).abs()
        e = torch.exp(-delta / scale)
        base = (1.0 - e) if mode == "confident" else e
        w = floor + (1.0 - floor) * base
        w = torch.where(v, w, torch.zeros_like(w))
        return _normalise(w, v)


def balance_weights(keep_new: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Class-balancing weights so keep (``y=+1``) and drop (``y=-1``) decisions
    contribute equally in total.

    Over the valid terms (whole tensor), with ``n`` valid terms of which
    ``n_keep`` keep and ``n_drop`` drop::

        w = n / (2 * n_keep)  for keep terms,   w = n / (2 * n_drop)  for drop terms

    so the weights have mean 1 over valid terms and each class sums to ``n/2``.
    If one class is absent the other gets weight 1.  Invalid terms get 0.
    ``valid`` defaults to all-True; pass e.g. ``t_bnd >= 0``.  Returns float32.
    """
    if not isinstance(keep_new, torch.Tensor):
        raise ValueError("keep_new must be a torch.Tensor")
    if valid is not None and tuple(valid.shape) != tuple(keep_new.shape):
        raise ValueError(f"valid must have shape {tuple(keep_new.shape)}, got {tuple(valid.shape)}")
    keep = keep_new.to(torch.bool)
    v = torch.ones_like(keep) if valid is None else valid.to(torch.bool)
    n = v.sum().float()
    n_keep = (keep & v).sum().float()
    n_drop = (~keep & v).sum().float()
    w = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
    if n == 0:
        return w
    if n_keep == 0 or n_drop == 0:
        return v.float()
    w_keep = n / (2.0 * n_keep)
    w_drop = n / (2.0 * n_drop)
    w = torch.where(keep, w_keep, w_drop)
    return torch.where(v, w, torch.zeros_like(w))


def _normalise(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = v.sum()
    if int(n) == 0:
        return torch.zeros_like(w)
    s = w.sum()
    if float(s) <= 0:
        return v.float()
    return w * (n.float() / s)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))`` averaged over unmasked tokens.

    Args:
        student_logits, teacher_logits: ``[..., V]`` (e.g. ``[B, S, V]``), same shape.
        temperature: ``T > 0``.
        mask: optional bool ``[...]`` (e.g. ``[B, S]``); True = token counts.

    The teacher is detached (a fixed target).  Math in float32.  Vocabulary
    entries where the teacher probability is exactly 0 (``-inf`` logits)
    contribute 0.  Returns 0 (attached to the student graph) if no token is unmasked.
    """
    if not isinstance(student_logits, torch.Tensor) or not isinstance(teacher_logits, torch.Tensor):
        raise ValueError("logits must be torch.Tensors")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"shape mismatch: student {tuple(student_logits.shape)} vs "
                         f"teacher {tuple(teacher_logits.shape)}")
    if student_logits.dim() < 1:
        raise ValueError("logits need a vocabulary dimension")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    lead = student_logits.shape[:-1]
    if mask is not None and tuple(mask.shape) != tuple(lead):
        raise ValueError(f"mask must have shape {tuple(lead)}, got {tuple(mask.shape)}")
    T = float(temperature)
    log_ps = F.log_softmax(student_logits.float() / T, dim=-1)
    log_pt = F.log_softmax(teacher_logits.detach().float() / T, dim=-1)
    kl_el = F.kl_div(log_ps, log_pt, reduction="none", log_target=True)  # pt * (log_pt - log_ps)
    kl_el = kl_el.masked_fill(log_pt == float("-inf"), 0.0)  # 0 log 0 = 0 where the teacher rules a token out
    kl = kl_el.sum(dim=-1) * (T * T)  # [...]
    if mask is None:
        return kl.mean() if kl.numel() > 0 else student_logits.sum() * 0.0
    m = mask.to(torch.bool)
    n = m.sum()
    if int(n) == 0:
        return student_logits.sum().float() * 0.0
    return torch.where(m, kl, torch.zeros_like(kl)).sum() / n.float()
