"""Bridges to other tools. Each submodule imports its tool on import; the library itself never imports them.

* :mod:`kvpop_hf.integrations.lm_eval`: the ``kvpop`` model of lm-evaluation-harness (``pip install -e ".[lm-eval]"``).
"""
