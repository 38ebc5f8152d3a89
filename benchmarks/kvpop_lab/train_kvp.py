"""Train KVP eviction agents offline on Q/K/V traces of a model (KVP, "Learning to Evict from Key-Value Cache",
Apple, ICML 2026) and write a KVpopCache checkpoint (scorer "kvp").

Examples::

    # record traces of the testbed teacher once, train with RL (Plackett-Luce + RLOO) for 5 minutes
    python training/train_kvp.py --model checkpoints/testbed-4k-teacher --out out/kvp --traces-file out/traces.pt \
        --objective rl --max-train-seconds 300

    # the supervised ablation on the same traces, then both side by side with the heuristics
    python training/train_kvp.py --model checkpoints/testbed-4k-teacher --out out/kvp_sup --traces-file out/traces.pt \
        --objective supervised --max-train-seconds 300
    python training/train_kvp.py --model checkpoints/testbed-4k-teacher --out out/eval --traces-file out/traces.pt \
        --eval-only --compare kvp=out/kvp kvp_supervised=out/kvp_sup --baselines knorm,streaming

The output directory holds ``kvpop_config.json`` + ``kvpop_scorer.safetensors`` (load with
``KVpopCache.from_pretrained``), ``train_state.pt`` (``--resume`` continues from it), ``train_log.csv``,
``meta.json`` (command, commit, date, versions) and the held-out normalised AUC cost per head
(``auc_cost.csv``, ``auc_cost.md``; with ``--budgets``, ``evicted_share.csv``). The same command is installed as
``kvpop-train-kvp``.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from kvpop_hf.baselines.kvp.metric import FRACTIONS, auc_cost_per_head, cost_table, eval_points, write_cost_csv
from kvpop_hf.baselines.kvp.supervised import LOSSES
from kvpop_hf.baselines.kvp.train import KVPTrainConfig, KVPTrainer
from kvpop_hf.cache import KVpopCache
from kvpop_hf.policies import parse_token_counts
from kvpop_hf.scorers import build_scorer
from kvpop_lab.utils.provenance import git_commit, versions

STATE = "train_state.pt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="checkpoints/testbed-4k-teacher", help="model directory (with its tokenizer)")
    p.add_argument("--out", required=True, help="output directory (KVpopCache checkpoint, state, logs)")
    p.add_argument("--traces-file", default=None, help="record traces into this file, or reuse it if it exists")
    p.add_argument("--families", default="reasoning,vt,niah_multikey,cwe,fwe", help="testbed families, comma-separated")
    p.add_argument("--length", type=int, default=1024, help="testbed problem length in tokens")
    p.add_argument("--knob", action="extend", nargs="+", default=[], metavar="FAMILY.KEY=VALUE",
                   help="testbed generator knobs of the traced problems, as kvpop-eval's --knob "
                        "(e.g. --knob reasoning.n_facts=10 reasoning.steps=4)")
    p.add_argument("--train-traces", type=int, default=32)
    p.add_argument("--heldout-traces", type=int, default=8)
    p.add_argument("--trace-seed", type=int, default=1234, help="seed of the training problems (held-out: +1)")
    p.add_argument("--objective", choices=("rl", "supervised"), default="rl")
    p.add_argument("--supervised-loss", choices=LOSSES, default="listnet")
    p.add_argument("--steps", type=int, default=2000, help="optimiser steps (in total, counting resumed ones)")
    p.add_argument("--max-train-seconds", type=float, default=None, help="stop (and save) after this long")
    p.add_argument("--samples", type=int, default=16, help="K permutations per trace (RLOO group)")
    p.add_argument("--traces-per-step", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-context", type=int, default=64)
    p.add_argument("--min-future", type=int, default=16)
    p.add_argument("--no-normalize-advantages", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--proj-dim", type=int, default=32)
    p.add_argument("--pos-dim", type=int, default=8)
    p.add_argument("--max-positions", type=int, default=None, help="position table rows (default: --length + 128)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--sinks", type=int, default=4, help="budget written into the checkpoint (and protected in "
                                                        "the 'cache' cost table)")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--topk", type=int, default=220)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help=f"continue from OUT/{STATE}")
    p.add_argument("--eval-only", action="store_true", help="no training: only the held-out cost tables")
    p.add_argument("--compare", nargs="*", default=[], metavar="NAME=DIR", help="KVpopCache checkpoints to score")
    p.add_argument("--baselines", default="knorm,streaming", help="heuristic scorers to score (comma-separated)")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="held-out context lengths / length")
    p.add_argument("--budgets", default="", help="also the share of future attention evicted at these budgets "
                                                 "(token counts B, comma-separated; cache ranking)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (small ops: 1 is fastest)")
    p.add_argument("--device", default="cpu", help="where traces are recorded, the agent trains and the held-out "
                                                  "costs are computed (cpu, cuda, cuda:1, ...)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.trace_knobs = trace_knobs(args)  # bad knobs fail here, before any work
    args.budget_tokens = parse_token_counts(args.budgets)  # as do ratios or other non-counts given to --budgets
    check_device(args.device)
    return args


def check_device(device: str) -> None:
    """A ``--device`` torch cannot use is an error before any work."""
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a torch device ({err}); use cpu, cuda or cuda:N.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asks for CUDA, which this torch build or machine lacks; use --device cpu.")


def trace_knobs(args) -> dict[str, dict]:
    """``--knob`` as ``{family: {knob: value}}``; a knob of a family not in ``--families`` is an error."""
    from .testbed.evaluate import parse_knobs

    fams = [f for f in args.families.split(",") if f]
    knobs = parse_knobs(args.knob, fams)
    stray = sorted(set(knobs) - set(fams))
    if stray:
        raise ValueError(f"--knob sets {', '.join(stray)}, which --families ({args.families}) does not trace; "
                         "add the family or drop the knob.")
    return knobs


def load_traces(args):
    """(train, heldout, model config) on ``--device``: from --traces-file if it exists, else recorded from
    --model (the file holds them on the CPU)."""
    from kvpop_hf.baselines.kvp.train import traces_to

    train, heldout, config = _load_traces(args)
    return traces_to(train, args.device), traces_to(heldout, args.device), config


def _load_traces(args):
    from transformers import AutoConfig

    meta = {"model": str(args.model), "families": args.families, "length": args.length,
            "train": args.train_traces, "heldout": args.heldout_traces, "seed": args.trace_seed}
    knobs = args.trace_knobs
    if knobs:  # absent otherwise, so that trace files recorded without knobs stay valid
        meta["knobs"] = knobs
    config = AutoConfig.from_pretrained(args.model)
    path = Path(args.traces_file) if args.traces_file else None
    if path is not None and path.is_file():
        data = torch.load(path, weights_only=True)
        if data["meta"] != meta:
            raise ValueError(f"{path} holds traces of {data['meta']}, not {meta}: use another --traces-file.")
        return data["train"], data["heldout"], config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .testbed.kvp_traces import testbed_traces

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().to(args.device)
    fams = [f for f in args.families.split(",") if f]
    kw = dict(length=args.length, progress=not args.no_progress, knobs=knobs)
    train = testbed_traces(model, tok, fams, n=args.train_traces, seed=args.trace_seed, **kw)
    heldout = testbed_traces(model, tok, fams, n=args.heldout_traces, seed=args.trace_seed + 1, **kw)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"meta": meta, "train": train, "heldout": heldout}, path)
    return train, heldout, config


def train(args, traces, config, out: Path) -> KVpopCache:
    from kvpop_hf.config import model_shape, require_full_attention

    require_full_attention(config, "KVP training")
    L, H, D = model_shape(config)
    name = "kvp" if args.objective == "rl" else "kvp_supervised"
    scorer = build_scorer("kvp", L, H, D, proj_dim=args.proj_dim, pos_dim=args.pos_dim,
                          max_positions=args.max_positions or args.length + 128, hidden=args.hidden,
                          trained_with=args.objective, seed=args.seed).to(args.device)
    cfg = KVPTrainConfig(objective=args.objective, supervised_loss=args.supervised_loss, samples=args.samples,
                         traces_per_step=args.traces_per_step, lr=args.lr, min_context=args.min_context,
                         min_future=args.min_future, normalize_advantages=not args.no_normalize_advantages,
                         seed=args.seed)
    trainer = KVPTrainer(scorer, traces, cfg)
    log_path = out / "train_log.csv"
    if args.resume and (out / STATE).is_file():
        trainer.load_state_dict(torch.load(out / STATE, weights_only=True))
        print(f"resumed {name} from step {trainer.step_count}")
    elif not args.resume and log_path.exists():
        log_path.unlink()
    from tqdm.auto import tqdm

    bar = tqdm(total=args.steps, initial=trainer.step_count, desc=f"train {name}", disable=args.no_progress)
    start, new_log = time.time(), not log_path.exists()
    with open(log_path, "a", newline="") as fh:
        log = csv.writer(fh)
        if new_log:
            log.writerow(["step", "loss", "train_auc_cost", "seconds"])
        while trainer.step_count < args.steps:
            stats = trainer.step()
            log.writerow([stats["step"], f"{stats['loss']:.6f}", f"{stats['cost']:.5f}", f"{time.time() - start:.1f}"])
            bar.update(1)
            bar.set_postfix(cost=f"{stats['cost']:.4f}")
            if trainer.step_count % args.save_every == 0:
                trainer.save(out / STATE)
                fh.flush()
            if args.max_train_seconds is not None and time.time() - start > args.max_train_seconds:
                break
    bar.close()
    trainer.save(out / STATE)
    scorer.requires_grad_(False).eval()
    cache = KVpopCache(config, sinks=args.sinks, window=args.window, topk=args.topk, scorer=scorer.cpu())
    cache.save_pretrained(out)
    scorer.to(args.device)  # the held-out costs are computed where the traces are
    print(f"{name}: {trainer.step_count} steps, checkpoint in {out}")
    return cache


def evaluate(args, heldout, config, policies: dict, out: Path) -> dict:
    """Normalised AUC cost per head on the held-out traces, pure ranking and with the cache's protection."""
    from kvpop_hf.config import model_shape, require_full_attention

    require_full_attention(config, "KVP training")
    L, H, D = model_shape(config)
    for base in [b for b in args.baselines.split(",") if b]:
        kw = {"lag": args.window} if base == "lagkv" else {}
        policies.setdefault(base, (build_scorer(base, L, H, D, **kw).to(args.device), None))
    points = eval_points(heldout, [float(f) for f in args.fractions.split(",")])
    tables = {}
    for ranking, protect in (("pure", None), ("cache", (args.sinks, args.window))):
        costs = {name: auc_cost_per_head(sc, heldout, points, args.window, protect, lg)
                 for name, (sc, lg) in policies.items()}
        tables[ranking] = costs
        first = "" if protect is None else f", sinks={args.sinks} and window={args.window} first"
        print(f"\nnormalised AUC cost C/C* on {len(heldout)} held-out traces x {len(points) // max(1, len(heldout))} "
              f"context lengths ({ranking} ranking{first}):")
        print(cost_table(costs))
    evicted = {}
    for b in args.budget_tokens:
        protect = (args.sinks, args.window)
        evicted[b] = {name: auc_cost_per_head(sc, heldout, points, args.window, protect, lg, budget=b)
                      for name, (sc, lg) in policies.items()}
        print(f"\nshare of future attention evicted at budget {b} (cache ranking):")
        print(cost_table(evicted[b], "evicted share"))
    with open(out / "auc_cost.md", "w") as fh:
        for ranking, costs in tables.items():
            fh.write(f"## {ranking} ranking: normalised AUC cost\n\n{cost_table(costs)}\n\n")
        for b, costs in evicted.items():
            fh.write(f"## cache ranking: share of future attention evicted at budget {b}\n\n"
                     f"{cost_table(costs, 'evicted share')}\n\n")
    write_cost_csv(tables, out / "auc_cost.csv")
    if evicted:
        write_cost_csv({f"cache@{b}": c for b, c in evicted.items()}, out / "evicted_share.csv", "evicted_share")
    return tables


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, out)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv: list[str], out: Path) -> int:
    traces, heldout, config = load_traces(args)
    policies = {}
    if not args.eval_only:
        cache = train(args, traces, config, out)
        policies["kvp" if args.objective == "rl" else "kvp_supervised"] = (cache.scorer, None)
    for spec in args.compare:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--compare expects NAME=DIR, got {spec!r}")
        ck = KVpopCache.from_pretrained(path, config)
        lg = ck.log_gamma.to(args.device) if ck.log_gamma is not None else None
        policies[name] = (ck.scorer.to(args.device), lg)
    evaluate(args, heldout, config, policies, out)
    meta = {"command": "python training/train_kvp.py " + shlex.join(argv), "args": vars(args),
            "commit": git_commit(Path(__file__).resolve().parent),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "versions": versions("torch", "transformers")}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return 0
