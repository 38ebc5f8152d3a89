"""One exact-match table (with binomial standard errors) from several evaluation folders.

The code is kvpop_lab/bench/eval_table.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.eval_table import main

if __name__ == "__main__":
    raise SystemExit(main())
