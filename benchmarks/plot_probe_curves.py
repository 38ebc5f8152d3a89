"""Plot the teacher-forced fact-lookup accuracy logged by ``pretrain_teacher.py --probe-every`` against the

The code is kvpop_lab/bench/plot_probe_curves.py (``pip install -e ./benchmarks``); ``--help`` lists the options."""

from kvpop_lab.bench.plot_probe_curves import main

if __name__ == "__main__":
    raise SystemExit(main())
