"""TOVA, H2O and SnapKV: policies that score cached tokens by the attention they receive.

:mod:`.policies` holds the scoring rules (a :class:`~kvpop_hf.scorers.Scorer` each), :mod:`.scores` the attention
pass that returns the weights they read, and :mod:`.layer` the cache layer that updates the scores every step.
"""
