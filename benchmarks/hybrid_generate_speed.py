"""Decode speed and memory of hybrid models through model.generate: KVpopCache against the model's default cache.

The code is kvpop_lab/bench/hybrid_generate_speed.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.hybrid_generate_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
