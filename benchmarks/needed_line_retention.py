"""How much of the lines an answer is made of a KVpop cache still holds when the prompt ends.

The code is kvpop_lab/bench/needed_line_retention.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.needed_line_retention import main

if __name__ == "__main__":
    raise SystemExit(main())
