"""`kvpop-retrofit`: the command-line front end in kvpop_hf/cli/retrofit.py (``--help`` lists its flags)."""

from kvpop_hf.cli.retrofit import main

if __name__ == "__main__":
    raise SystemExit(main())
