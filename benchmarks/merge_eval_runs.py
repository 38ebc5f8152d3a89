"""Merge the ``results.csv`` of several ``kvpop-eval`` runs (e.g. one run per budget range) into one

The code is kvpop_lab/bench/merge_eval_runs.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.merge_eval_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
