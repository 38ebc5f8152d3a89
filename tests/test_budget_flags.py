"""kvpop_hf.cli.budget_flags: --sinks/--window/--topk with a command's defaults, and the hidden --budget that stops
the parse with an error naming them (whatever follows it) and leaves no ``args.budget``."""

from __future__ import annotations

import argparse

import pytest

from kvpop_hf.cli.budget_flags import add_budget_flags

pytestmark = pytest.mark.tier("unit")


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


@pytest.mark.tier("scripts")
@pytest.mark.parametrize("module, defaults, triple", [
    ("chunk_host_ops", (4, 64, 188), ["--budget", "4", "64", "188"]),
    ("generation_speed", (4, 256, 3836), ["--shape", "tiny", "--budget", "4", "16", "44"]),
    ("split_model_generation", (4, 256, 3836), ["--devices", "cpu", "cpu", "--budget", "2", "8", "14"]),
])
def test_each_speed_benchmark_shows_its_defaults_and_refuses_the_triple(module, defaults, triple, capsys):
    import importlib

    main = importlib.import_module(f"kvpop_lab.bench.{module}").main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    s, w, k = defaults
    assert f"--sinks SINKS default {s}" in text and f"--window WINDOW default {w}" in text
    assert f"--topk TOPK default {k}" in text and "--budget" not in text
    with pytest.raises(SystemExit) as exc:
        main(triple)
    assert exc.value.code == 2 and "pass --sinks {} --window {} --topk {}".format(*triple[-3:]) in capsys.readouterr().err
