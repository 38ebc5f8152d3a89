"""Training KVpop scorers: targets, losses, the sparse student forward and the Trainer."""

from .chunked_distillation import chunked_distillation_loss
from .distillation import DistillationTrainer, StudentPass
from .losses import balance_weights, boundary_loss, distillation_loss, margin_weights
from ..ops.priorities import sequence_priorities
from .student import StudentSettings, student_forward
from ..ops.targets import dense_causal_lse, future_attention_target, future_attention_target_reference
from .trainer import KVpopTrainer, KVpopTrainingArguments

__all__ = ["DistillationTrainer", "StudentPass", "KVpopTrainer", "KVpopTrainingArguments", "StudentSettings",
           "student_forward", "sequence_priorities", "boundary_loss", "distillation_loss", "chunked_distillation_loss",
           "margin_weights", "balance_weights", "dense_causal_lse", "future_attention_target",
           "future_attention_target_reference"]
