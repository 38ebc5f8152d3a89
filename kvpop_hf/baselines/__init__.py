"""The baselines KVpop is compared with, one module or subpackage per method.

* training-free scorers for :class:`~kvpop_hf.KVpopCache`: :mod:`.heuristics` (StreamingLLM, K-Norm, random),
  :mod:`.keydiff`, :mod:`.lagkv`;
* :mod:`.attention_policies`: TOVA, H2O and SnapKV, which score tokens from the attention weights and so need
  their own cache layer and attention pass;
* :mod:`.kvp`: KVP, a learned scorer trained on key/value traces with its own trainer;
* :mod:`.dms`: DMS, learned eviction decisions with delayed eviction, its own cache and trainer.

StreamingLLM+ is sinks and a window with the backbone fine-tuned to them: ``KVpopTrainer`` with ``topk=0``.

Importing this package (``import kvpop_hf`` does) registers the baselines' scorers in
:data:`kvpop_hf.scorers.SCORERS` by name; each module is imported on its scorer's first use.
"""

from ..scorer_registry import register_scorer

# the baselines' scorers, by path: registering imports none of them (``import kvpop_hf`` imports this package)
for _name, _path in {
    "streaming": "kvpop_hf.baselines.heuristics:StreamingScorer",
    "knorm": "kvpop_hf.baselines.heuristics:KNormScorer",
    "random": "kvpop_hf.baselines.heuristics:RandomScorer",
    "keydiff": "kvpop_hf.baselines.keydiff:KeyDiffScorer",
    "lagkv": "kvpop_hf.baselines.lagkv:LagKVScorer",
    "tova": "kvpop_hf.baselines.attention_policies.policies:TOVAPolicy",
    "h2o": "kvpop_hf.baselines.attention_policies.policies:H2OPolicy",
    "snapkv": "kvpop_hf.baselines.attention_policies.policies:SnapKVPolicy",
    "kvp": "kvpop_hf.baselines.kvp.scorer:KVPScorer",
}.items():
    register_scorer(_name, _path)
del _name, _path
