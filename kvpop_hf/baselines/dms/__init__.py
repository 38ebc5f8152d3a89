"""DMS (Dynamic Memory Sparsification): learned per-head eviction gates with delayed eviction.

The learned-eviction baseline of KVpop (arXiv:2607.05061), after Łańcucki et al. (2025). One idea a module:
``gate`` (decision logits from the hidden state), ``relaxation`` (Gumbel-sigmoid), ``mask`` (the delayed-eviction
rule, relaxed and hard), ``compression`` (target rate, schedule, penalty), ``train_attention`` (the training
forward), ``layer`` / ``handoff`` / ``cache`` (inference with ragged per-head memory), ``trainer`` (distillation).
"""

from .cache import DMSCache, DMSPrototype
from .compression import CompressionSchedule, compression_loss, mean_eviction, target_eviction_rate
from .config import DMSConfig
from .gate import DMSGate

__all__ = ["DMSCache", "DMSPrototype", "DMSConfig", "DMSGate", "CompressionSchedule", "compression_loss",
           "mean_eviction", "target_eviction_rate"]
