"""The baselines KVpop is compared with, one module or subpackage per method.

* training-free scorers for :class:`~kvpop_hf.KVpopCache`: :mod:`.heuristics` (StreamingLLM, K-Norm, random),
  :mod:`.keydiff`, :mod:`.lagkv`;
* :mod:`.attention_policies`: TOVA, H2O and SnapKV, which score tokens from the attention weights and so need
  their own cache layer and attention pass;
* :mod:`.kvp`: KVP, a learned scorer trained on key/value traces with its own trainer;
* :mod:`.dms`: DMS, learned eviction decisions with delayed eviction, its own cache and trainer.

StreamingLLM+ is sinks and a window with the backbone fine-tuned to them: ``KVpopTrainer`` with ``topk=0``.
"""
