"""`kvpop-train-dms`: the command-line front end in kvpop_hf/cli/train_dms.py (``--help`` lists its flags)."""

from kvpop_hf.cli.train_dms import main

if __name__ == "__main__":
    raise SystemExit(main())
