"""kvpop_hf.cli.budget_flags: --sinks/--window/--topk with a command's defaults, and the hidden --budget that stops
the parse with an error naming them (whatever follows it) and leaves no ``args.budget``."""

from __future__ import annotations

import argparse

import pytest

from kvpop_hf.cli.budget_flags import add_budget_flags


def parser(**defaults) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cmd")
    add_budget_flags(ap, **defaults)
    return ap


def test_defaults_and_given_values():
    assert vars(parser().parse_args([])) == {"sinks": 4, "window": 256, "topk": 3836}  # no args.budget
    args = parser(sinks=4, window=64, topk=188).parse_args(["--window", "16", "--topk", "0"])
    assert (args.sinks, args.window, args.topk) == (4, 16, 0)
    args = parser(sinks=None, window=None, topk=None).parse_args(["--sinks", "2"])
    assert (args.sinks, args.window, args.topk) == (2, None, None)


SAME = "--sinks 4 --window 16 --topk 44"  # the budget given as --budget 4 16 44
EXAMPLE = "--sinks 4 --window 256 --topk 3836"


@pytest.mark.parametrize("argv, fix", [(["--budget", "4", "16", "44"], SAME), (["--budget=4"], EXAMPLE),
                                       (["--budget"], EXAMPLE),
                                       (["--sinks", "2", "--budget", "4", "16", "44", "--topk", "3"], SAME)])
def test_budget_names_the_new_flags(argv, fix, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--budget takes no SINKS WINDOW TOPK triple here; the budget is --sinks S --window W --topk K" in err and "unrecognized" not in err
    assert err.rstrip().endswith(f"pass {fix}")


def test_help_shows_the_flags_and_hides_budget():
    text = parser(sinks=None, window=None, topk=None, default_note="default: the checkpoint's").format_help()
    assert "--sinks SINKS" in text and "--topk TOPK" in text and "default: the checkpoint's" in text
    assert "--budget" not in text
    assert "default 188" in parser(topk=188).format_help()
