"""Whole-model training step at real scale: KVpopTrainer against a plain LoRA step, on one GPU.

The code is kvpop_lab/bench/training_scale.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.training_scale import main

if __name__ == "__main__":
    raise SystemExit(main())
