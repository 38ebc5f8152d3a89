"""KVpopCache with a model split across devices (an accelerate device map) against the same model on one.

The code is kvpop_lab/bench/split_model_generation.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.split_model_generation import main

if __name__ == "__main__":
    raise SystemExit(main())
