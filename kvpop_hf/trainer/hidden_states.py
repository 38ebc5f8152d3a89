"""A causal LM's final hidden states without its full-vocabulary logits.

``model(**inputs, logits_to_keep=<no position>)`` runs the whole model (through its PEFT / DDP / FSDP
wrappers, so their hooks and adapters apply) but projects no position onto the vocabulary; a forward hook on
the decoder (``get_decoder()``, e.g. ``Qwen3Model``) picks up its ``last_hidden_state``, the input of the LM
head after the final norm. :mod:`.chunked_distillation` then applies the head chunk by chunk.
"""

from __future__ import annotations

import torch
from torch import nn


def unwrap_model(model):
    """The transformers model under DDP / PEFT wrappers."""
    model = getattr(model, "module", model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def lm_head_of(model) -> nn.Linear:
    """The LM head of ``model`` (a plain ``nn.Linear``); a clear error for heads the chunked loss cannot use."""
    head = unwrap_model(model).get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"The chunked distillation loss needs a plain nn.Linear LM head; this model's is "
                         f"{type(head).__name__} (e.g. LoRA on lm_head): leave lm_head out of the LoRA "
                         "target_modules.")
    return head


def head_weights(head: nn.Linear):
    """(weight, bias) of ``head`` as full tensors (an FSDP2-sharded head is gathered, differentiably)."""
    def full(p):
        return p.full_tensor() if p is not None and hasattr(p, "full_tensor") else p

    return full(head.weight), full(head.bias)


def final_hidden_states(model, **inputs):
    """``model(**inputs)`` without logits -> (model outputs, final hidden states ``[B, S, H]``)."""
    decoder = unwrap_model(model).get_decoder()
    captured = {}

    def hook(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    handle = decoder.register_forward_hook(hook)
    try:
        outputs = model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=ids.device))
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise ValueError(f"{type(unwrap_model(model)).__name__}.get_decoder() did not run in the forward: the "
                         "chunked distillation needs the decoder's last_hidden_state.")
    return outputs, captured["hidden"]
