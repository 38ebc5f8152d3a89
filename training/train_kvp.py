"""`kvpop-train-kvp`: the command-line front end in benchmarks/kvpop_lab/train_kvp.py (``--help`` lists its flags)."""

from kvpop_lab.train_kvp import main

if __name__ == "__main__":
    raise SystemExit(main())
