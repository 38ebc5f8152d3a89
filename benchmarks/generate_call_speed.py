"""Decode speed and memory measured through ``model.generate`` exactly as a user calls it.

The code is kvpop_lab/bench/generate_call_speed.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.generate_call_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
