"""Host-side cost of one prompt chunk: torch operator calls per layer, by scorer and chunk length.

The code is kvpop_lab/bench/chunk_host_ops.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.chunk_host_ops import main

if __name__ == "__main__":
    raise SystemExit(main())
