"""The budget options of the laboratory's command lines: ``--compression`` (ratios in (0, 1) of ``--length``) and
``--budgets`` (token counts ``B = sinks + window + topk`` per layer and KV head), which combine; the default
ratios apply only when neither is given. :func:`kvpop_hf.policies.parse_budgets` checks and builds them."""

from __future__ import annotations

import argparse

__all__ = ["add_budget_args", "budgets_from_args"]


def add_budget_args(ap: argparse.ArgumentParser, default: str) -> None:
    """Add ``--compression`` and ``--budgets``; ``default``: the ratios used when neither is given (e.g.
    ``"0.75,0.88"``)."""
    ap.add_argument("--compression", default=None, metavar="CR[,CR...]",
                    help="compression ratios in (0, 1), comma separated: B = round((1 - cr) * --length) entries "
                         f"per layer and KV head (default: {default} when --budgets is not given)")
    ap.add_argument("--budgets", default=None, metavar="B[,B...]",
                    help="token counts, comma separated: B = sinks + window + topk entries per layer and KV head "
                         "(with --compression, both sets of budgets are used)")
    ap.set_defaults(default_compression=default)


def budgets_from_args(args: argparse.Namespace, length: int, sinks: int, window: int) -> list:
    """The :class:`kvpop_hf.policies.Budget` list of ``args`` (parsed by a parser given :func:`add_budget_args`):
    ``--compression`` ratios then ``--budgets`` counts, or the default ratios when neither was given. Bad values
    raise ValueError naming the option and the fix."""
    from kvpop_hf.policies import parse_budgets

    compression, budgets = args.compression, args.budgets
    if compression is None and budgets is None:
        compression = args.default_compression
    return parse_budgets(compression=compression, budgets=budgets, length=length, sinks=sinks, window=window)
