"""Oracle eviction on the testbed: exact match, token and fact-lookup accuracy when the cache keeps the

The code is kvpop_lab/bench/oracle_eviction.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.oracle_eviction import main

if __name__ == "__main__":
    raise SystemExit(main())
