"""Distillation from the dense teacher through final hidden states (shared by KVpopTrainer and DMSTrainer).

The teacher is a frozen copy of the model or, for a PEFT student, the same model with its adapters disabled.
Both passes return final hidden states (:mod:`.hidden_states`) and the KL is taken through the LM heads chunk by
chunk (:mod:`.chunked_distillation`), so no ``tokens x vocabulary`` tensor is held at any sequence length.
"""

from __future__ import annotations

import torch

from .chunked_distillation import chunked_distillation_loss
from .hidden_states import final_hidden_states, head_weights, lm_head_of


def teacher_hidden_states(model, teacher_model, input_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[B, S, H]`` of the teacher (no gradient): ``teacher_model`` if given, else ``model``
    (a PEFT model, possibly wrapped by DDP) with its adapters disabled."""
    with torch.no_grad():
        if teacher_model is not None:
            return final_hidden_states(teacher_model, input_ids=input_ids)[1]
        peft_model = model if hasattr(model, "disable_adapter") else getattr(model, "module", model)
        if not hasattr(peft_model, "disable_adapter"):
            raise ValueError("No teacher: pass teacher_model, or train a PEFT (LoRA) student whose adapter-free "
                             "self is the teacher.")
        with peft_model.disable_adapter():
            return final_hidden_states(model, input_ids=input_ids)[1]


def supervised_positions(labels: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, S]`` bool: the positions whose next token has a label (``labels[:, 1:] != -100``), the tokens the
    distillation averages over; None without labels."""
    if labels is None:
        return None
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != -100
    return mask


def distillation_from_hidden(model, teacher_model, hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                             temperature: float, mask: torch.Tensor | None) -> torch.Tensor:
    """``T^2 KL(teacher || student)`` over the unmasked tokens, from the student's ``hidden`` and the teacher's
    ``teacher_hidden`` ``[B, S, H]`` through each one's LM head (the student's for a PEFT teacher)."""
    head = lm_head_of(model)
    t_head = head if teacher_model is None else lm_head_of(teacher_model)
    weight, bias = head_weights(head)
    t_weight, t_bias = head_weights(t_head)
    return chunked_distillation_loss(hidden, teacher_hidden, weight, bias, t_weight, t_bias, temperature, mask,
                                     softcap=final_logit_softcap(model))


def final_logit_softcap(model) -> float | None:
    """The model's final logit softcapping (``final_logit_softcapping``, Gemma2), None where it has none."""
    from .hidden_states import unwrap_model

    config = getattr(unwrap_model(model), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "final_logit_softcapping", None) or None
