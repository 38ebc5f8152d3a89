"""The same testbed problems through ``kvpop-eval`` and through lm-eval's command line with ``--model kvpop``:

The code is kvpop_lab/bench/lm_eval_vs_kvpop_eval.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.lm_eval_vs_kvpop_eval import main

if __name__ == "__main__":
    raise SystemExit(main())
