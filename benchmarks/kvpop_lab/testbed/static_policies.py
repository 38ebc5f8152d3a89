"""The static-priority policies of the oracle-recall benchmarks (``benchmarks/oracle_recall_profile.py``,
``benchmarks/causal_recall_bound.py``): heuristics, scorer-only checkpoints on the dense model's keys, and
distilled students on their own, at every budget, as the ``(policy, budget, cache[, own_model])`` tuples that
:func:`kvpop_lab.testbed.analysis.oracle_recall_rows` and
:func:`kvpop_lab.testbed.recall_bound.twin_recall_rows` take."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .budget_args import add_budget_args, budgets_from_args

__all__ = ["add_benchmark_args", "add_policy_args", "check_policy_args", "static_policies", "benchmark_setup"]


def add_benchmark_args(ap: argparse.ArgumentParser) -> None:
    """The options :func:`benchmark_setup` reads: ``--model``, ``--out``, ``--length``, ``--n``, ``--sinks``,
    ``--window``, ``--compression`` (default 0.88) / ``--budgets``, ``--knob``, ``--device`` and those of
    :func:`add_policy_args`."""
    ap.add_argument("--model", required=True, help="the dense model whose future attention is the oracle")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4, help="problems (reasoning family, seeds 2**48 + i)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    add_budget_args(ap, default="0.88")
    ap.add_argument("--knob", action="append", default=[], help="reasoning.<name>=<int>, as in kvpop-eval")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_policy_args(ap)


def add_policy_args(ap: argparse.ArgumentParser) -> None:
    """``--student``, ``--scorer``, ``--baselines`` and ``--log-gammas``."""
    ap.add_argument("--student", action="append", default=[],
                    help="NAME=DIR: a distilled student (model and cache in DIR); its scorer reads its own keys")
    ap.add_argument("--scorer", action="append", default=[],
                    help="NAME=DIR: a scorer checkpoint on --model's keys (scorer-only retrofit)")
    ap.add_argument("--baselines", default="streaming", help="static heuristics to compare, comma-separated")
    ap.add_argument("--log-gammas", default="",
                    help="also each --scorer/--student with these recency decays (negative floats, comma-separated; "
                         "policy name <name>_lg<x>; write --log-gammas=-0.02,-0.1), to see whether recency "
                         "explains the oracle's order")


def check_policy_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad ``add_policy_args`` values through ``ap.error``; parses ``args.log_gammas`` to floats."""
    for spec in args.student + args.scorer:
        if "=" not in spec:
            ap.error(f"--student/--scorer take NAME=DIR, got {spec!r}")
        if not Path(spec.split("=", 1)[1]).is_dir():
            ap.error(f"{spec!r}: no such checkpoint folder")
    args.log_gammas = parse_log_gammas(ap, args.log_gammas)


def parse_log_gammas(ap: argparse.ArgumentParser, text: str) -> list[float]:
    """``"-0.02,-0.1"`` -> ``[-0.02, -0.1]``; anything but negative floats is refused through ``ap.error``."""
    try:
        gammas = [float(x) for x in text.split(",") if x]
    except ValueError:
        ap.error(f"--log-gammas takes negative floats like -0.02,-0.1, got {text!r}")
    if any(not x < 0 for x in gammas):
        ap.error("--log-gammas must be negative (the log of a decay factor in (0, 1))")
    return gammas


def static_policies(args: argparse.Namespace, model, budgets, sinks: int, window: int, device) -> list[tuple]:
    """The policies named by ``args`` (see :func:`add_policy_args`) at each of ``budgets``. A student's model is
    loaded once (float32, on ``device``) and shared by its budgets and decays."""
    from kvpop_hf import KVpopCache
    from .models import load_model

    scored, students = [], {}
    for b in budgets:
        over = dict(sinks=sinks, window=window, topk=b.topk)
        for name in [n for n in args.baselines.split(",") if n]:
            scored.append((name, b, KVpopCache(model.config, scorer=name, **over)))
        for lg in [None] + list(args.log_gammas):
            tag = "" if lg is None else f"_lg{lg:g}"
            for spec in args.scorer:
                name, path = spec.split("=", 1)
                scored.append((name + tag, b, served_at(path, model.config, log_gamma=lg, **over)))
            for spec in args.student:
                name, path = spec.split("=", 1)
                if path not in students:
                    students[path] = load_model(path, torch.float32, device)
                student = students[path]
                cache = served_at(path, student.config, log_gamma=lg, **over)
                scored.append((name + tag, b, cache, student))
    return scored


def served_at(path, model_config, **fields):
    """A checkpoint's scorer in a cache with other budget fields (``sinks``, ``window``, ``topk``, ``log_gamma``):
    what a study of a scorer away from its trained ``s`` and ``w`` needs, which ``KVpopCache.from_pretrained``
    refuses for serving. The checkpoint loads as a prototype and its scorer (read-only, shared) goes into a new
    cache of the changed config; a learned per-head decay of the checkpoint replaces ``log_gamma`` as there."""
    import dataclasses

    from kvpop_hf import KVpopCache

    proto = KVpopCache.from_pretrained(path)
    cfg = dataclasses.replace(proto.kvpop_config, scorer_kwargs=dict(proto.kvpop_config.scorer_kwargs), **fields)
    cfg.validate()
    cache = KVpopCache(model_config, scorer=proto.scorer, kvpop_config=cfg)
    if proto.log_gamma is not None:
        cache.log_gamma = proto.log_gamma.clone()
    return cache


def benchmark_setup(args: argparse.Namespace):
    """What both oracle-recall benchmarks start from, read off their common options (``--model``, ``--length``,
    ``--n``, ``--sinks``, ``--window``, ``--compression``/``--budgets``, ``--knob``, ``--device`` and
    :func:`add_policy_args`'s): ``(model, tokenizer, problems, scored)`` -- the dense model (float32), its
    tokenizer, ``--n`` reasoning problems (seeds ``2**48 + i``, the knobs applied) and :func:`static_policies` at
    every budget. Bad budgets or knobs raise before any model is loaded."""
    from transformers import AutoTokenizer

    from .evaluate import parse_knobs
    from .models import load_model
    from .tasks import make_problem

    budgets = budgets_from_args(args, args.length, args.sinks, args.window)
    knobs = parse_knobs(args.knob, ["reasoning"]).get("reasoning", {})
    device = torch.device(args.device)
    model = load_model(args.model, torch.float32, device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    problems = [make_problem("reasoning", length=args.length, seed=2 ** 48 + i, **knobs) for i in range(args.n)]
    return model, tokenizer, problems, static_policies(args, model, budgets, args.sinks, args.window, device)
