"""Where a scorer's oracle top-k recall is lost: recall of the oracle's best m tokens, for several m, and the

The code is kvpop_lab/bench/oracle_recall_profile.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.oracle_recall_profile import main

if __name__ == "__main__":
    raise SystemExit(main())
