"""Exact match against oracle top-k recall, one point per trained policy: does a scorer that follows its oracle

The code is kvpop_lab/bench/recall_vs_quality.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.recall_vs_quality import main

if __name__ == "__main__":
    raise SystemExit(main())
