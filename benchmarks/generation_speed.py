"""Long-context generation speed and memory: dense caches vs KVpopCache, eager and compiled decoding.

The code is kvpop_lab/bench/generation_speed.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.generation_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
