"""Oracle eviction on the testbed: exact match, token and fact-lookup accuracy when the cache keeps the
tokens the dense model's future attention uses (KVpop's training target replayed; not a causal policy).

    python benchmarks/oracle_eviction.py --out results/oracle_eviction_cpu --length 1024 --n 10 \\
        --compression 0.25,0.5,0.75,0.88

Same problems, seeds and output format as ``kvpop-eval`` (``results.csv``, ``meta.json``, ``table.md``),
so ``benchmarks/merge_eval_runs.py`` can put the oracle rows next to the real policies. Per problem one
dense pass over ``<bos> prompt target <eos>`` gives the oracle priorities (``kvpop_lab.testbed.oracle``);
then for each budget a teacher-forced pass (token / fact-lookup accuracy) and a greedy generation (exact
match) run with a ``KVpopCache`` holding ``B = sinks + window + topk`` entries per head.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from kvpop_hf import KVpopCache
from kvpop_lab.utils.provenance import git_commit
from kvpop_lab.testbed import make_problem, training_example
from kvpop_lab.testbed.budget_args import add_budget_args, budgets_from_args
from kvpop_lab.testbed.dense_eval import exact_match
from kvpop_lab.testbed.evaluate import DEFAULT_SEED_BASE, parse_knobs, token_accuracy
from kvpop_lab.testbed.oracle import OracleScorer, oracle_kind_arg, oracle_table, target_queries
from kvpop_hf.backends import Backends
from kvpop_lab.testbed.report import quality_table, write_results_csv
from kvpop_lab.testbed.static_policies import parse_log_gammas

ROOT = Path(__file__).resolve().parents[3]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="checkpoints/testbed-4k-teacher")
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="reasoning")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--knob", action="append", default=[], help="generator knob FAMILY.KEY=VALUE (repeatable), "
                    "as in kvpop-eval")
    add_budget_args(ap, default="0.25,0.5,0.75,0.88")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--seed-base", type=int, default=DEFAULT_SEED_BASE)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kind", type=oracle_kind_arg, default="mean",
                    help="mean: the paper's future-attention target (mean over later queries); max: the largest "
                         "attention weight any later query gives the token; p<x> (e.g. p4): their power mean of "
                         "order x > 1, between the two")
    ap.add_argument("--queries", choices=["all", "target"], default="all",
                    help="all: every later query counts (the paper's target); target: only the queries that generate "
                         "the reference answer (trace and answer tokens)")
    ap.add_argument("--log-gammas", default="",
                    help="also evaluate the oracle with these recency decays (negative floats, e.g. -0.1,-0.5): the "
                         "priority of token t becomes oracle_t - floor(t / 64) * log_gamma, the paper's Eq. 5 decay "
                         "(rows <policy>_lg<log_gamma>)")
    args = ap.parse_args(argv)
    gammas = parse_log_gammas(ap, args.log_gammas)
    policy = ("oracle" if args.kind == "mean" else f"oracle_{args.kind}") + ("_target" if args.queries == "target" else "")
    budgets = budgets_from_args(args, args.length, args.sinks, args.window)  # bad budgets fail here
    knobs = parse_knobs(args.knob, [args.family]).get(args.family, {})  # bad knobs fail here
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (expected a model folder)")
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="kvpop").to(device).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    head_dim = model.config.head_dim
    seeds = [args.seed_base + i for i in range(args.n)]
    problems = [make_problem(args.family, length=args.length, seed=s, **knobs) for s in seeds]
    runs = [(b, g) for g in [None] + gammas for b in budgets]
    stats = {(b.B, g): {"em": 0, "tok_c": 0, "tok_n": 0, "lk_c": 0, "lk_n": 0} for b, g in runs}
    for p in tqdm(problems, desc="oracle"):
        ex = training_example(p, tok)
        ids = torch.tensor([ex["input_ids"]], device=device)
        qmask = target_queries(torch.tensor([ex["labels"]], device=device)) if args.queries == "target" else None
        table = oracle_table(model, ids, args.window, backend=Backends.defaults(device, ("target_pass",)).target_pass,
                             kind=args.kind, query_mask=qmask)
        for b, g in runs:
            def factory(b=b, g=g):
                return KVpopCache(model.config, sinks=b.sinks, window=b.window, topk=b.topk, log_gamma=g,
                                  scorer=OracleScorer(table).bind_head_dim(head_dim))
            ta = token_accuracy(model, tok, [p], cache_factory=factory, progress=False)
            em = exact_match(model, tok, [p], batch_size=1, cache_factory=factory, progress=False)
            s = stats[b.B, g]
            s["em"] += em["em"][p.family]
            s["tok_c"] += ta["correct"][p.family]
            s["tok_n"] += ta["total"][p.family]
            s["lk_c"] += ta["lookup_correct"].get(p.family, 0)
            s["lk_n"] += ta["lookup_total"].get(p.family, 0)
    rows = []
    for b, g in runs:
        s = stats[b.B, g]
        rows.append({"policy": policy + ("" if g is None else f"_lg{g:g}"), "budget": str(b.B), "cr": float(b.cr),
                     "sinks": b.sinks, "window": b.window, "topk": b.topk, "family": args.family, "em": s["em"] / len(problems),
                     "token_acc": s["tok_c"] / max(1, s["tok_n"]),
                     "lookup_acc": s["lk_c"] / s["lk_n"] if s["lk_n"] else float("nan"), "n": len(problems),
                     "n_target_tokens": s["tok_n"]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results_csv(rows, out / "results.csv")
    command = shlex.join(["python", "benchmarks/oracle_eviction.py"] + list(argv if argv is not None else sys.argv[1:]))
    meta = {"command": command, "git_commit": git_commit(), "model": args.model, "length": args.length,
            "n_per_family": args.n, "families": [args.family], "knobs": {args.family: knobs} if knobs else {},
            "seeds": {"base": args.seed_base, "rule": "problem i of each family: make_problem(family, length, "
                      "seed=base + i)", "per_family": {args.family: [seeds[0], seeds[-1]]}},
            "device": str(device), "kind": args.kind, "queries": args.queries,
            "note": "oracle = the dense model's future-attention priorities (mean or max over later queries) "
                    "replayed through KVpopCache (not causal; see benchmarks/kvpop_lab/testbed/oracle.py)"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    table = quality_table(rows, [args.family], f"Oracle eviction, {args.kind} future attention ({args.family}, {args.n} problems of "
                                               f"{args.length} tokens)")
    (out / "table.md").write_text(f"<!-- {command} -->\n<!-- git {meta['git_commit']} -->\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
