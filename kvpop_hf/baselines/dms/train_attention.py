"""The DMS student forward: attention implementation ``"dms_train"`` (training only).

In a forward run by :func:`dms_forward` every layer reads its gate logits from the value states
(:class:`~kvpop_hf.baselines.dms.gate.DMSGate`), draws relaxed decisions (:mod:`~kvpop_hf.baselines.dms.relaxation`) and attends
with the delayed-eviction bias of :func:`~kvpop_hf.baselines.dms.mask.soft_eviction_bias`; the decisions go to the call's
record for the compression penalty. The call travels as the forward keyword ``dms_student`` (Qwen3/Llama-style
models pass forward keywords down to the attention function), so it belongs to that forward alone; a forward
without it is plain causal attention, which makes the same model (LoRA adapters disabled) the dense teacher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface

from ...ops.dense_attention import causal_attention
from ...trainer.hidden_states import final_hidden_states
from .mask import soft_eviction_bias
from .relaxation import eviction_probability, log_keep, relaxed_logits

TRAIN_ATTN_NAME = "dms_train"
DMS_KWARG = "dms_student"


@dataclass
class DMSRecord:
    """Per-forward results by layer: relaxed decisions ``alpha [b, h, S]`` (with gradient) and the fraction of
    hard decisions (``logit > 0``, tokens ``t >= sinks``), what the inference cache would evict."""

    alpha: dict = field(default_factory=dict)
    hard_rate: dict = field(default_factory=dict)


class DMSCall:
    """What one student forward hands to every layer's ``dms_train`` attention (a plain class: wrappers that
    rebuild dataclass arguments pass it on as is)."""

    __slots__ = ("gate", "sinks", "window", "temperature", "noise", "record")

    def __init__(self, gate, sinks: int, window: int, temperature: float, record: DMSRecord, noise: bool = True):
        self.gate, self.sinks, self.window = gate, sinks, window
        self.temperature, self.noise, self.record = temperature, noise, record


def dms_forward(model, gate, sinks: int, window: int, temperature: float, noise: bool = True,
                return_hidden: bool = False, **inputs):
    """``model(**inputs)`` with the relaxed DMS eviction -> (outputs, :class:`DMSRecord`); with
    ``return_hidden=True`` no logits are computed and the final hidden states ``[B, S, H]`` come third."""
    record = DMSRecord()
    call = {DMS_KWARG: DMSCall(gate, sinks, window, temperature, record, noise)}
    hidden = None
    if return_hidden:
        outputs, hidden = final_hidden_states(model, **inputs, **call)
    else:
        outputs = model(**inputs, **call)
    if not record.alpha:
        raise ValueError(f"No layer ran the DMS student attention: call model.set_attn_implementation("
                         f"'{TRAIN_ATTN_NAME}') first.")
    return (outputs, record, hidden) if return_hidden else (outputs, record)


def soft_biased_attention(query, key, value, bias, scaling):
    """query ``[b, Hq, S, d]``, key/value ``[b, Hkv, S, d]``, bias ``[b, Hkv, S, S]`` (shared by the query heads
    of a KV head) -> ``[b, S, Hq, d]``. The query heads of a KV head are stacked along the query axis, so
    neither keys, values nor the bias are copied per query head."""
    b, hq, S, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    q = query.reshape(b, hkv, g * S, d)
    mask = bias.to(query.dtype)[:, :, None].expand(b, hkv, g, S, bias.shape[-1]).reshape(b, hkv, g * S, -1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, S, value.shape[-1]).transpose(1, 2).contiguous()


def dms_train_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    call = kwargs.get(DMS_KWARG)
    if call is None:
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
        return causal_attention(query, key, value, mask, scaling), None
    li = module.layer_idx
    logits = call.gate(li, value.detach())  # [b, Hkv, S]; the backbone gets no gradient through the gate input
    z = relaxed_logits(logits, call.temperature, noise=call.noise)
    call.record.alpha[li] = eviction_probability(z)
    with torch.no_grad():
        call.record.hard_rate[li] = (logits[..., call.sinks:] > 0).float().mean()
    bias = soft_eviction_bias(log_keep(z), call.sinks, call.window)
    return soft_biased_attention(query, key, value, bias, scaling), None


def _train_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("DMS training needs unpadded sequences: batch sequences of equal length.")
    return None


def register() -> None:
    AttentionInterface.register(TRAIN_ATTN_NAME, dms_train_attention)
    AttentionMaskInterface.register(TRAIN_ATTN_NAME, _train_mask)


register()
