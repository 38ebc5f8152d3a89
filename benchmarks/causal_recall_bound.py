"""The highest oracle top-k recall any causal eviction policy can reach on the testbed, beside the recall the

The code is kvpop_lab/bench/causal_recall_bound.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.causal_recall_bound import main

if __name__ == "__main__":
    raise SystemExit(main())
