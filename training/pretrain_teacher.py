"""`kvpop-pretrain-teacher`: the command-line front end in kvpop_hf/cli/pretrain_teacher.py (``--help`` lists its flags)."""

from kvpop_hf.cli.pretrain_teacher import main

if __name__ == "__main__":
    raise SystemExit(main())
