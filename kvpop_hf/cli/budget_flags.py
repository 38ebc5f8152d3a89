"""The cache budget on a command line: ``--sinks S --window W --topk K`` (``B = S + W + K`` entries per KV head),
the spelling of every kvpop-hf command. A hidden ``--budget`` stops the parse with an error that names these flags.
"""

from __future__ import annotations

import argparse

__all__ = ["add_budget_flags"]

RETIRED = "--budget takes no SINKS WINDOW TOPK triple here; the budget is --sinks S --window W --topk K"


class _RetiredBudget(argparse.Action):
    """``--budget ...``: a parser error naming ``--sinks``, ``--window`` and ``--topk`` (given three values, the
    same budget in those flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        example = values if len(values) == 3 else ["4", "256", "3836"]
        parser.error(f"{RETIRED}: pass {' '.join(f'--{n} {v}' for n, v in zip(('sinks', 'window', 'topk'), example))}")


def add_budget_flags(ap: argparse.ArgumentParser, sinks: int | None = 4, window: int | None = 256,
                     topk: int | None = 3836, default_note: str | None = None) -> None:
    """Add ``--sinks``, ``--window`` and ``--topk`` (ints, these defaults; None: not given) and a hidden
    ``--budget`` that stops the parse. ``default_note``: the three flags' help when a default is None."""
    for name, default in (("sinks", sinks), ("window", window), ("topk", topk)):
        ap.add_argument(f"--{name}", type=int, default=default,
                        help=default_note if default is None and default_note else f"default {default}")
    ap.add_argument("--budget", nargs="*", action=_RetiredBudget, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

