"""KVP: per-head eviction agents trained offline by ranking (KVP, "Learning to Evict from Key-Value Cache",
Apple, ICML 2026).

* :mod:`.ranking`: Plackett-Luce log-probability, Gumbel-sort sampling, RLOO advantages;
* :mod:`.reward`: future attention of a recorded trace and the normalised rank-weighted AUC cost;
* :mod:`.supervised`: the supervised ranking losses of the paper's ablation;
* :mod:`.traces`: Q/K/V traces recorded once from a model;
* :mod:`.metric`: normalised AUC cost per head of any static-priority policy;
* :mod:`.train`: the offline training loop (no language model in it).

The agent itself is the scorer ``"kvp"`` (:class:`kvpop_hf.baselines.kvp.scorer.KVPScorer`).
"""
