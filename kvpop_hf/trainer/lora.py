"""LoRA students: the model with adapters on its attention projections, whose adapter-free self is the teacher."""

from __future__ import annotations


def require_peft():
    """The ``peft`` module, or an ImportError that names the extra that installs it."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("--lora_rank needs the `peft` package: pip install -e \".[train]\" (or pip install "
                          "peft).") from err
    return peft


def lora_student(model, rank: int):
    """``rank > 0``: the model with LoRA adapters (rank ``rank``, alpha ``2 * rank``) on the attention
    projections, the student whose adapter-free self is the teacher; ``rank == 0``: the model unchanged."""
    if rank <= 0:
        return model
    peft = require_peft()

    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
