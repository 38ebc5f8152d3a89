"""Leave-families-out retrofits: plan, training records, held-out tables and curve (benchmarks/gpu/leave_families_out.sh).

The code is kvpop_lab/bench/leave_families_out.py (``pip install -e ./benchmarks``); ``--help`` lists the commands."""

from kvpop_lab.bench.leave_families_out import main

if __name__ == "__main__":
    raise SystemExit(main())
