"""Continuous batching (kvpop_hf.generate_batch) against static batches through model.generate.

The code is kvpop_lab/bench/generate_batch_speed.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.generate_batch_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
