"""Distillation loss from final hidden states, never holding full-vocabulary logits.

``losses.distillation_loss`` takes ``[B, S, V]`` logits of student and teacher and works in float32: at
``S = 32768`` and ``V = 151936`` one such tensor is 18.6 GiB, and the reference holds several. This module
computes the same quantity,

    ``T^2 * KL(softmax(z_t / T) || softmax(z_s / T))`` averaged over the unmasked tokens,
    ``z_s = h_s W_s^T (+ b_s)``, ``z_t = h_t W_t^T (+ b_t)``,

from the final hidden states ``h [.., H]`` and the LM head, ``chunk_size`` tokens at a time. The gradient
is formed in the forward pass, chunk by chunk (``dL/dz_s = T (p_s - p_t) / n`` per unmasked token), so the
backward only scales it: nothing of size ``tokens x V`` outlives a chunk. Peak extra memory is a few
``chunk_size x V`` float32 buffers (``chunk_size`` defaults to what keeps one buffer near 512 MiB) plus a
float32 gradient of ``W_s`` when the head is trained.

The logits of a chunk are computed in the dtype of the hidden states and the head (as ``lm_head`` does)
and cast to float32, as the reference does with the model's logits, so both see the same values.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["chunked_distillation_loss", "chunked_lm_loss", "default_chunk_size"]

_CHUNK_ELEMENTS = 1 << 27  # float32 elements of one chunk x V buffer (512 MiB)


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that one ``chunk x vocab_size`` float32 buffer stays near 512 MiB."""
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def _logits(h, weight, bias, softcap: Optional[float] = None):
    """float32 logits of ``h`` through the head; ``softcap``: the model's final logit cap ``c tanh(z / c)`` (Gemma2)."""
    z = F.linear(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype)).float()
    return z if not softcap else torch.tanh(z / softcap) * softcap


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, h_t, w_s, b_s, w_t, b_t, weight, temperature, chunk_size, softcap=None):
        # h_s, h_t [N, H]; weight [N] float32 (mask / n_unmasked, 0 for masked tokens)
        T = float(temperature)
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[2]
        need_b = b_s is not None and ctx.needs_input_grad[3]
        grad_h = torch.zeros_like(h_s) if need_h else None
        grad_w = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if need_w else None
        grad_b = torch.zeros(b_s.shape, dtype=torch.float32, device=b_s.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=h_s.device)
        rows = weight.nonzero().squeeze(-1)  # masked tokens cost nothing
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start:start + chunk_size]
            hs, ht, wc = h_s.index_select(0, idx), h_t.index_select(0, idx), weight.index_select(0, idx)
            z_s = _logits(hs, w_s, b_s, softcap)
            log_ps = torch.log_softmax(z_s / T, dim=-1)
            log_pt = torch.log_softmax(_logits(ht, w_t, b_t, softcap) / T, dim=-1)
            p_t = log_pt.exp()
            # p_t * (log p_t - log p_s), with 0 where the teacher rules a token out (0 log 0 = 0)
            kl = torch.where(p_t > 0, p_t * (log_pt - log_ps), torch.zeros_like(p_t)).sum(-1)
            total += (kl * wc).sum() * (T * T)
            if need_h or need_w or need_b:
                # d/dz_s of T^2 * KL at z/T: T * (p_s - p_t), times the token weight
                g = (log_ps.exp_() - p_t).mul_(wc[:, None] * T)
                if softcap:  # through the cap: d(c tanh(u / c))/du = 1 - (z / c)^2
                    g.mul_(1 - (z_s / softcap) ** 2)
                del log_pt, p_t, z_s
                if need_h:
                    grad_h.index_copy_(0, idx, (g.to(hs.dtype) @ w_s.to(hs.dtype)).to(h_s.dtype))
                if need_w:
                    grad_w.addmm_(g.t(), hs.float())
                if need_b:
                    grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.w_dtype, ctx.b_dtype = w_s.dtype, None if b_s is None else b_s.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_out.float()
        gh = None if grad_h is None else grad_h * scale.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * scale).to(ctx.w_dtype)
        gb = None if grad_b is None else (grad_b * scale).to(ctx.b_dtype)
        return gh, None, gw, gb, None, None, None, None, None, None


def chunked_distillation_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, head_weight: torch.Tensor,
                              head_bias: Optional[torch.Tensor] = None, teacher_head_weight: Optional[torch.Tensor] = None,
                              teacher_head_bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                              mask: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                              softcap: Optional[float] = None) -> torch.Tensor:
    """``losses.distillation_loss(h_s W^T + b, h_t W_t^T + b_t, temperature, mask)`` without the logits.

    Args:
        student_hidden: ``[..., H]`` final hidden states of the student (after the final norm); differentiable.
        teacher_hidden: ``[..., H]``, same shape; detached (a fixed target).
        head_weight, head_bias: the student's LM head ``[V, H]`` (and ``[V]``); they get gradients if they
            require them.
        teacher_head_weight, teacher_head_bias: the teacher's head (default: the student's, as for a LoRA
            student whose teacher is the same model with its adapters disabled).
        temperature: ``T > 0``.
        mask: optional bool ``[...]``; True = the token counts.
        chunk_size: tokens per chunk (default :func:`default_chunk_size`).
        softcap: the model's final logit softcapping (``config.final_logit_softcapping``, Gemma2): both heads' logits
            are ``c tanh(z / c)``, as the model's own logits.

    Returns a float32 scalar; 0 (attached to the student graph) if no token is unmasked.
    """
    if not isinstance(student_hidden, torch.Tensor) or not isinstance(teacher_hidden, torch.Tensor):
        raise ValueError("hidden states must be torch.Tensors")
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(f"shape mismatch: student hidden {tuple(student_hidden.shape)} vs "
                         f"teacher hidden {tuple(teacher_hidden.shape)}")
    if student_hidden.dim() < 1 or head_weight.dim() != 2 or head_weight.shape[1] != student_hidden.shape[-1]:
        raise ValueError(f"head_weight must be [V, {student_hidden.shape[-1] if student_hidden.dim() else '?'}], "
                         f"got {tuple(head_weight.shape)}")
    t_weight = head_weight if teacher_head_weight is None else teacher_head_weight
    t_bias = head_bias if teacher_head_weight is None else teacher_head_bias
    if t_weight.shape != head_weight.shape:
        raise ValueError(f"teacher head {tuple(t_weight.shape)} differs from the student's {tuple(head_weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if chunk_size is None:
        chunk_size = default_chunk_size(head_weight.shape[0])
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
    lead = student_hidden.shape[:-1]
    if mask is not None and tuple(mask.shape) != tuple(lead):
        raise ValueError(f"mask must have shape {tuple(lead)}, got {tuple(mask.shape)}")
    h_s = student_hidden.reshape(-1, student_hidden.shape[-1])
    h_t = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    m = torch.ones(h_s.shape[0], dtype=torch.bool, device=h_s.device) if mask is None else \
        mask.reshape(-1).to(device=h_s.device, dtype=torch.bool)
    n = int(m.sum())
    if n == 0:
        return student_hidden.sum().float() * 0.0
    weight = m.float() / n
    loss = _ChunkedKL.apply(h_s, h_t, head_weight, head_bias, t_weight.detach(),
                            None if t_bias is None else t_bias.detach(), weight, float(temperature), int(chunk_size),
                            softcap or None)
    return loss


@torch.no_grad()
def chunked_lm_loss(hidden: torch.Tensor, head_weight: torch.Tensor, head_bias: Optional[torch.Tensor],
                    labels: torch.Tensor, chunk_size: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """The causal-LM loss (next-token cross entropy, labels ``-100`` ignored) of ``hidden [B, S, H]`` through the
    head ``[V, H]``, ``chunk_size`` tokens at a time; no gradient (a logged quantity)."""
    chunk_size = chunk_size or default_chunk_size(head_weight.shape[0])
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1).to(h.device)
    rows = (y != -100).nonzero().squeeze(-1)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start:start + chunk_size]
        total += F.cross_entropy(_logits(h.index_select(0, idx), head_weight, head_bias, softcap), y.index_select(0, idx),
                                 reduction="sum")
    return total / max(1, rows.numel())
