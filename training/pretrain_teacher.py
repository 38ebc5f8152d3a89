"""`kvpop-pretrain-teacher`: the command-line front end in benchmarks/kvpop_lab/pretrain_teacher.py (``--help`` lists its flags)."""

from kvpop_lab.pretrain_teacher import main

if __name__ == "__main__":
    raise SystemExit(main())
