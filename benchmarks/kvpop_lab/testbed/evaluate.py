"""Quality of KV-eviction policies on the testbed: ``python -m kvpop_lab.testbed.evaluate`` (``kvpop-eval``).

Example (the testbed teacher, two budgets, learned scorers from a checkpoints folder)::

    kvpop-eval --model checkpoints/testbed-4k-teacher --length 2048 --n 50 --sinks 4 --window 64 \\
        --compression 0.75,0.88 --policies dense,streaming,knorm,random,kvpop_mlp,kvpop \\
        --checkpoints-dir out/scorers --knob reasoning.steps=4 --knob reasoning.n_facts=16 \\
        --out results/eval_2048 --analysis

For every family (default: all five) ``--n`` problems of ``--length`` tokens are generated with seeds
``--seed-base + i`` (default ``2**48 + i``: disjoint from the teacher's ``getrandbits(48)`` and the
retrofit script's ``randrange(2**30)`` training seeds). Each policy x budget gets:

* ``em``: greedy exact match of the whole target (reasoning: trace + answer) with a fresh cache per
  batch (:func:`kvpop_lab.testbed.dense_eval.exact_match`);
* ``token_acc``: teacher-forced next-token accuracy on the reference target tokens (+ ``<eos>``),
  micro-averaged over tokens; ``<bos> prompt target <eos>`` goes through the model with the policy's
  cache in one forward (or ``--chunk`` tokens at a time). With ``attn_implementation="kvpop"`` every
  query sees exactly its own budget set, so this is the policy's loss-free quality signal.

Budgets: ``--compression`` ratios (``0.75`` -> ``B = round(0.25 * length)``) and/or ``--budgets`` token counts
(``256`` -> ``B = 256``); ``topk = B - sinks - window``.
Learned scorers: ``--scorer-checkpoint POLICY[@TAG]=DIR`` (TAG: ``cr75``, ``b256``, ``0.75`` or
``256``; none = any budget) and/or ``--checkpoints-dir DIR`` with subfolders ``<policy>[_cr<NN>|_b<B>]``
(``kvpop_mlp_cr75``, ``kvpop_cr88``, ``kvpop_immediate`` ...); see :mod:`kvpop_hf.policies`.
Policies with their own weights (``streaming_plus``: sinks + window, model distilled at the budget) take a
model directory as checkpoint (``--checkpoints-dir checkpoints`` finds ``streaming_plus_cr75`` ...) and are
evaluated with that model, one at a time; ``--model`` serves every other policy and ``--analysis``.

Outputs in ``--out``: ``results.csv``, ``outputs.jsonl`` (per problem and policy), ``table1.md`` (in-domain families, paper Table 1),
``table2.md`` (out-of-domain, paper Table 2), ``quality_vs_budget.png``, ``meta.json``; with
``--analysis`` also ``recall_per_layer.csv/.png`` (oracle top-k recall, Fig. 7), ``retention_heatmap.png`` (Fig. 6, of
the policy with the best exact match at the highest compression) and,
when both ``kvpop`` and ``kvpop_immediate`` ran, ``ablation_delay.md/.png`` (Fig. 5).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvpop_hf.compat import with_cache
from . import analysis, report
from .budget_args import add_budget_args, budgets_from_args
from kvpop_hf import policies as pol
from .models import LastModel, holds_model, load_model
from .models import model_config as checkpoint_model_config
from .oracle import oracle_kind_arg
from .tasks import ALL_FAMILIES, FAMILIES, Problem, make_problem, training_example

__all__ = ["build_parser", "check_knobs", "parse_knobs", "plan_from_args", "token_accuracy", "main", "EvalPlan",
           "DEFAULT_SEED_BASE"]

DEFAULT_SEED_BASE = 2 ** 48
DEFAULT_POLICIES = ("dense", "streaming", "knorm", "random", "keydiff", "lagkv", "tova", "h2o", "snapkv", "kvpop_mlp",
                    "kvpop", "kvpop_immediate", "kvp", "kvp_supervised")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpop-eval", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory or Hub id (loaded with attn 'kvpop')")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model's, else build_tokenizer())")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma list from {', '.join(ALL_FAMILIES)} (default: the evaluated {', '.join(FAMILIES)})")
    ap.add_argument("--in-domain", default="reasoning",
                    help="families the scorers were trained on (table1); the others go to table2")
    ap.add_argument("--policies", default=None,
                    help=f"comma list from the registry (default: {','.join(DEFAULT_POLICIES)}, learned ones "
                         "only where a checkpoint is given)")
    ap.add_argument("--n", type=int, default=50, help="problems per family")
    ap.add_argument("--length", type=int, default=2048, help="tokens per problem (<bos> prompt target <eos>)")
    add_budget_args(ap, default="0.75,0.88")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--seed-base", type=int, default=DEFAULT_SEED_BASE, help="problem i uses seed SEED_BASE + i")
    ap.add_argument("--knob", action="append", default=[], help="generator knob FAMILY.KEY=VALUE (repeatable)")
    ap.add_argument("--scorer-checkpoint", action="append", default=[], metavar="POLICY[@TAG]=DIR",
                    help="checkpoint of a learned policy, optionally for one budget (repeatable)")
    ap.add_argument("--checkpoints-dir", default=None, help="folder of <policy>[_cr<NN>|_b<B>] checkpoints")
    ap.add_argument("--batch-size", type=int, default=8, help="generation batch size")
    ap.add_argument("--chunk", type=int, default=0, help="teacher-forced forward in chunks of this many tokens "
                                                         "(0: one forward per problem)")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="exact match: feed each prompt in chunks of this many tokens to the policies whose kept sets "
                         "do not depend on the chunking (static scores, the learned scorers; the same answers, much "
                         "less work on CPU); TOVA, H2O, SnapKV, DMS and dense take one chunk. 0: one chunk for all")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--skip-em", action="store_true", help="only the teacher-forced token accuracy")
    ap.add_argument("--analysis", action="store_true", help="oracle top-k recall per layer, retention heatmap, delay ablation")
    ap.add_argument("--analysis-n", type=int, default=2, help="reasoning problems used by --analysis")
    ap.add_argument("--oracle-kind", type=oracle_kind_arg, default="mean",
                    help="--analysis: the oracle of the top-k recall, mean (paper), max or p<x> (power mean of "
                         "order x > 1, e.g. p4) future attention")
    ap.add_argument("--oracle-queries", choices=["all", "target"], default="all",
                    help="--analysis: the later queries the oracle counts, all (paper) or those of the answer")
    ap.add_argument("--no-progress", action="store_true")
    return ap


# -- planning: every check that needs no model weights ------------------------------------------------
@dataclass
class Run:
    policy: str
    budget: pol.Budget | None  # None: dense
    checkpoint: str | None = None
    prototype: Any = None  # loaded KVpopCache of a learned policy

    @property
    def own_model(self) -> bool:
        """Evaluated with the model stored in ``checkpoint`` instead of ``--model``."""
        return pol.POLICIES[self.policy].own_model

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}@B{self.budget.B}"

    def factory(self) -> Callable[[Any], Any]:
        """``model_config -> fresh cache`` (None for dense)."""
        f = pol.bind_factory(self.policy, self.prototype)
        b = self.budget
        if b is None:
            return lambda cfg: f(cfg, 0, 1, 0)
        return lambda cfg: f(cfg, b.sinks, b.window, b.topk)


@dataclass
class EvalPlan:
    families: list[str]
    in_domain: list[str]
    budgets: list[pol.Budget]
    runs: list[Run]
    problems: dict[str, list[Problem]]
    seeds: dict[str, list[int]]
    knobs: dict[str, dict]
    notes: list[str] = field(default_factory=list)


def _split(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def parse_knobs(items: Sequence[str], families: Sequence[str] = ()) -> dict[str, dict]:
    """``["reasoning.steps=4", ...]`` -> ``{"reasoning": {"steps": 4}}`` (values through ``literal_eval``);
    a malformed item or an unknown family raises ValueError. Shared by kvpop-eval and the training scripts."""
    out: dict[str, dict] = {}
    for item in items:
        key, eq, val = item.partition("=")
        fam, dot, name = key.partition(".")
        if not eq or not dot or not name:
            raise ValueError(f"--knob expects FAMILY.KEY=VALUE, got {item!r}.")
        if fam not in ALL_FAMILIES:
            raise ValueError(f"--knob {item!r}: unknown family {fam!r}; valid: {', '.join(ALL_FAMILIES)}.")
        try:
            value = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            value = val
        out.setdefault(fam, {})[name.strip()] = value
    return out


def check_knobs(items: Sequence[str], length: int) -> dict[str, dict]:
    """Parses ``items`` (:func:`parse_knobs`) and draws one problem of ``length`` tokens per named family with its
    knobs, so a bad knob name or value raises ValueError (naming the knob) before a script starts any work."""
    knobs = parse_knobs(items)
    for fam, kw in knobs.items():
        make_problem(fam, length=length, seed=0, **kw)
    return knobs


def plan_from_args(args: argparse.Namespace) -> EvalPlan:
    """Validate the arguments, generate the problems and load checkpoint prototypes; raises ValueError
    with a clear message for bad input. No model weights are touched."""
    families = _split(args.families)
    bad = [f for f in families if f not in ALL_FAMILIES]
    if bad or not families:
        raise ValueError(f"Unknown family {bad or args.families!r}; valid families: {', '.join(ALL_FAMILIES)}.")
    in_domain = _split(args.in_domain)
    bad = [f for f in in_domain if f not in ALL_FAMILIES]
    if bad:
        raise ValueError(f"--in-domain: unknown family {bad}; valid families: {', '.join(ALL_FAMILIES)}.")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}.")
    for name in ("sinks", "window"):
        if getattr(args, name) < (0 if name == "sinks" else 1):
            raise ValueError(f"--{name} must be >= {0 if name == 'sinks' else 1}, got {getattr(args, name)}.")
    if args.batch_size < 1 or args.chunk < 0 or args.analysis_n < 1 or args.prefill_chunk < 0:
        raise ValueError("--batch-size and --analysis-n must be >= 1 and --chunk and --prefill-chunk >= 0.")
    budgets = budgets_from_args(args, args.length, args.sinks, args.window)

    ckpts = pol.parse_checkpoint_specs(args.scorer_checkpoint)
    if args.checkpoints_dir:
        found = pol.scan_checkpoints_dir(args.checkpoints_dir)
        ckpts = {**found, **ckpts}  # explicit --scorer-checkpoint wins
    explicit = args.policies is not None
    names = _split(args.policies) if explicit else list(DEFAULT_POLICIES)
    bad = [p for p in names if p not in pol.POLICIES]
    if bad or not names:
        raise ValueError(f"Unknown policy {bad or args.policies!r}; registered policies: {sorted(pol.POLICIES)}.")
    if len(set(names)) != len(names):
        raise ValueError(f"Duplicate policies in {names}.")

    notes: list[str] = []
    runs: list[Run] = []
    protos: dict[str, Any] = {}
    for name in names:
        spec = pol.POLICIES[name]
        if spec.dense:
            runs.append(Run(name, None))
            continue
        for b in budgets:
            path = pol.resolve_checkpoint(ckpts, name, b) if spec.needs_checkpoint else None
            if spec.needs_checkpoint and path is None:
                if explicit:
                    raise ValueError(
                        f"Policy {name!r} needs a scorer checkpoint for budget {b.spec} (tags {pol.budget_tags(b)}): "
                        f"pass --scorer-checkpoint {name}@{b.tag}=DIR or --checkpoints-dir with a {name}_{b.tag} "
                        "subfolder.")
                if any(n == name for n, _ in ckpts):
                    notes.append(f"{name} skipped at B={b.B}: no checkpoint for tags {pol.budget_tags(b)} "
                                 "and no untagged one.")
                continue  # default policy list: learned policies without checkpoints are skipped
            proto = None
            b = pol.policy_budget(name, b)
            if path is not None:
                if spec.own_model and not holds_model(path):
                    raise ValueError(f"Policy {name!r} is evaluated with its own weights, but {path} holds no model "
                                     "(config.json) and no LoRA adapter (adapter_config.json): save it with "
                                     "training/retrofit.py --lora_rank R (an adapter) or a full --train_backbone run.")
                if path not in protos:
                    protos[path] = pol.load_prototype(name, path)
                proto = protos[path]
                c = getattr(proto, "kvpop_config", None)  # a DMS checkpoint has its own config (no topk)
                if c is not None and (c.sinks, c.window, c.topk) != (b.sinks, b.window, b.topk):
                    notes.append(f"{name} at B={b.B}: checkpoint {path} was saved with sinks={c.sinks}, "
                                 f"window={c.window}, topk={c.topk}; evaluated with {b.sinks}/{b.window}/{b.topk}.")
            runs.append(Run(name, b, path, proto))
    if not runs:
        raise ValueError("Nothing to evaluate: no policy left (learned policies need checkpoints).")

    knobs = parse_knobs(args.knob, families)
    problems: dict[str, list[Problem]] = {}
    seeds: dict[str, list[int]] = {}
    for fam in families:
        seeds[fam] = [args.seed_base + i for i in range(args.n)]
        problems[fam] = [make_problem(fam, length=args.length, seed=s, **knobs.get(fam, {})) for s in seeds[fam]]
    if args.analysis and "reasoning" not in families:
        raise ValueError("--analysis uses reasoning problems: add 'reasoning' to --families.")
    return EvalPlan(families, in_domain, budgets, runs, problems, seeds, knobs, notes)


# -- teacher-forced next-token accuracy ----------------------------------------------------------------
@torch.no_grad()
def token_accuracy(model: Any, tokenizer: Any, problems: Sequence[Problem],
                   cache_factory: Callable[[], Any] | None = None, chunk: int = 0, progress: bool = True) -> dict:
    """Greedy next-token accuracy on the reference target tokens (``target`` + ``<eos>``).

    Each problem is run alone (batch 1, no padding): ``ids = <bos> prompt target <eos>`` ``[1, T]``
    through the model with a fresh cache from ``cache_factory`` (None: dense, one forward without cache), in
    one forward or in chunks of ``chunk`` tokens (eviction caches only). Position ``i`` predicts ``ids[i+1]``; only target positions count.
    Attention-based policies (TOVA, H2O, SnapKV; docs/design.md §7) attend densely inside a chunk, so with
    ``chunk=0`` they get the prompt as one chunk and the target token by token.
    Also the *fact-lookup accuracy*: the same greedy accuracy restricted to the target tokens that copy a
    fact's value (the ``9`` after ``x40 =`` in a ``reasoning`` trace, where ``x40`` is one of the problem's
    facts); chance is about 0.1. It is the part of the target that needs the far context, so it is what
    eviction can break even when the model gets the rest of the trace right.
    Returns ``{"acc": {family: float, "all": float}, "correct": {...}, "total": {...}, "per_problem": [...],
    "lookup_acc": {family: float}, "lookup_correct": {...}, "lookup_total": {...}}`` (the lookup entries only
    for families with fact lookups).
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    lk_correct: dict[str, int] = {}
    lk_total: dict[str, int] = {}
    per_problem: list[float] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(problems), desc="token_acc", leave=False)
    try:
        for p in problems:
            ex = training_example(p, tokenizer, mode="trace")
            ids = torch.tensor([ex["input_ids"]], device=device)
            labels = torch.tensor(ex["labels"], device=device)
            cache = cache_factory() if cache_factory is not None else None
            T = ids.shape[1]
            if cache is None:  # dense: one plain causal forward
                logits = model(ids, use_cache=False).logits[0]
            else:
                starts = list(range(0, T, chunk or T))
                scorer = getattr(cache, "scorer", None)  # None: a cache without a scorer (DMSCache)
                if not chunk and scorer is not None and scorer.dynamic:
                    # attention-based policies (TOVA, H2O, SnapKV) attend densely inside a chunk: the prompt
                    # as one chunk (compressed at its end), then the target token by token
                    first = int((labels != -100).nonzero()[0]) if bool((labels != -100).any()) else T
                    starts = [0] + list(range(max(first, 1), T))
                ends = starts[1:] + [T]
                logits = torch.cat([model(ids[:, a:e], **with_cache(model, cache, use_cache=True)).logits[0]
                                    for a, e in zip(starts, ends)], 0)
            pred = logits[:-1].argmax(-1)
            gold, mask = labels[1:], labels[1:] != -100
            right = pred == gold
            hit = int((right & mask).sum())
            n = int(mask.sum())
            lookup = _fact_lookup_mask(p, ids[0], tokenizer) & mask
            if bool(lookup.any()):
                lk_correct[p.family] = lk_correct.get(p.family, 0) + int((right & lookup).sum())
                lk_total[p.family] = lk_total.get(p.family, 0) + int(lookup.sum())
            correct[p.family] = correct.get(p.family, 0) + hit
            total[p.family] = total.get(p.family, 0) + n
            per_problem.append(hit / max(n, 1))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    acc = {f: correct[f] / total[f] for f in total if total[f]}
    n_all = sum(total.values())
    acc["all"] = sum(correct.values()) / n_all if n_all else float("nan")
    lookup_acc = {f: lk_correct[f] / lk_total[f] for f in lk_total if lk_total[f]}
    return {"acc": acc, "correct": correct, "total": total, "per_problem": per_problem, "lookup_acc": lookup_acc,
            "lookup_correct": lk_correct, "lookup_total": lk_total}


def _fact_lookup_mask(problem: Problem, ids: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """``[T-1]`` bool: position ``i`` predicts a fact value, i.e. ``ids[i-1]`` is one of the problem's fact
    names and ``ids[i]`` is ``=`` (fact names are single tokens of the testbed vocabulary)."""
    facts = problem.meta.get("facts") or {}
    out = torch.zeros(ids.shape[0] - 1, dtype=torch.bool, device=ids.device)
    if not facts or ids.shape[0] < 3:
        return out
    names = tokenizer.convert_tokens_to_ids(list(facts))
    unk = getattr(tokenizer, "unk_token_id", None)
    names = torch.tensor([n for n in names if n is not None and n != unk], device=ids.device, dtype=ids.dtype)
    eq = tokenizer.convert_tokens_to_ids("=")
    out[1:] = torch.isin(ids[:-2], names) & (ids[1:-1] == eq)
    return out


# -- model / tokenizer ---------------------------------------------------------------------------------
def _load_tokenizer(args):
    from transformers import AutoTokenizer

    from .tokenizer import build_tokenizer

    src = args.tokenizer or args.model
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError):
        if args.tokenizer:
            raise
        tok = build_tokenizer()
    tok.padding_side = "left"
    return tok


def _check_shapes(plan: EvalPlan, model_config, tokenizer=None) -> None:
    """Build one cache per run from its model's config (and check the vocabulary): shape mismatches fail
    before the weights load."""
    for run in plan.runs:
        cfg = checkpoint_model_config(run.checkpoint) if run.own_model else model_config
        run.factory()(cfg)
        vocab = getattr(cfg.get_text_config(), "vocab_size", None)
        if tokenizer is not None and vocab is not None and len(tokenizer) > vocab:
            where = run.checkpoint if run.own_model else "the model"
            raise ValueError(f"The tokenizer has {len(tokenizer)} tokens but {where} only {vocab}.")


# -- main ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import kvpop_hf  # noqa: F401  (registers attn_implementation="kvpop")
    from transformers import AutoConfig

    from .dense_eval import exact_match

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    plan = plan_from_args(args)  # all input errors surface here
    model_config = AutoConfig.from_pretrained(args.model)
    tokenizer = _load_tokenizer(args)
    vocab = getattr(model_config.get_text_config(), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"The tokenizer has {len(tokenizer)} tokens but the model only {vocab}.")
    _check_shapes(plan, model_config, tokenizer)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype, device)
    progress = not args.no_progress
    for note in plan.notes:
        print("note:", note, file=sys.stderr)

    all_problems = [p for fam in plan.families for p in plan.problems[fam]]
    rows: list[dict] = []
    timings: dict[str, float] = {}
    compression: dict[str, dict] = {}
    outputs = open(out / "outputs.jsonl", "w")
    from tqdm.auto import tqdm

    students = LastModel(dtype, device)  # a policy's own weights, loaded once for all its budgets
    for run in tqdm(plan.runs, desc="policies", disable=not progress):
        t0 = time.time()
        make = run.factory()
        run_model = students.get(run.checkpoint) if run.own_model else model
        factory = None if run.budget is None else (lambda make=make, m=run_model: make(m.config))
        made: list = []  # this run's teacher-forced caches, for policies that report their own compression
        tf = token_accuracy(run_model, tokenizer, all_problems, factory if factory is None else
                            (lambda f=factory: made.append(f()) or made[-1]), chunk=args.chunk, progress=progress)
        if made and hasattr(made[0], "compression"):
            compression[run.label] = report.compression_summary([c.compression() for c in made])
            print(f"{run.label}: kept fraction {compression[run.label]['kept_fraction']:.4f}, mean kept entries "
                  f"per head {compression[run.label]['kept_entries']:.1f}", file=sys.stderr)
        del made
        em = None
        if not args.skip_em:
            em = exact_match(run_model, tokenizer, all_problems, batch_size=args.batch_size, cache_factory=factory,
                             prefill_chunk=args.prefill_chunk,
                             progress=progress)
        del run_model
        timings[run.label] = round(time.time() - t0, 2)
        b = run.budget
        for i, p in enumerate(all_problems):
            rec = {"policy": run.policy, "budget": "full" if b is None else b.B, "family": p.family,
                   "seed": plan.seeds[p.family][i % args.n], "token_acc": tf["per_problem"][i]}
            if em is not None:
                o = em["outputs"][i]
                rec.update(correct=o["correct"], answer=o["answer"], prediction=o["prediction"], generated=o["generated"])
            outputs.write(json.dumps(rec) + "\n")
        for fam in plan.families:
            rows.append({
                "policy": run.policy, "budget": "full" if b is None else b.B,
                "cr": 0.0 if b is None else round(b.cr, 4),
                "sinks": "" if b is None else b.sinks, "window": "" if b is None else b.window,
                "topk": "" if b is None else b.topk, "family": fam,
                "em": float("nan") if em is None else em["em"][fam],
                "token_acc": tf["acc"][fam], "lookup_acc": tf["lookup_acc"].get(fam, float("nan")),
                "n": len(plan.problems[fam]), "n_target_tokens": tf["total"][fam],
            })

    outputs.close()
    report.write_results_csv(rows, out / "results.csv")
    meta = report.build_meta(argv, args, plan, timings, device, dtype)
    header = report.md_header(meta)
    ood = [f for f in plan.families if f not in plan.in_domain]
    ind = [f for f in plan.families if f in plan.in_domain]
    t1 = header + report.quality_table(rows, ind, "Table 1: in-domain families (" + ", ".join(ind or ["none"]) + ")")
    t2 = header + report.quality_table(rows, ood, "Table 2: out-of-domain families (" + ", ".join(ood or ["none"]) + ")")
    (out / "table1.md").write_text(t1)
    (out / "table2.md").write_text(t2)
    report.plot_quality(rows, out / "quality_vs_budget.png")
    print(t1)
    print(t2)

    recall = None
    if args.analysis:
        meta["analysis"], recall = analysis.run_all(model, tokenizer, plan, out, args, progress=progress,
                                                    rows=rows, students=students)
    students.clear()
    md = analysis.ablation_delay(rows, recall)  # only when both kvpop and kvpop_immediate ran
    if md is not None:
        (out / "ablation_delay.md").write_text(header + md)
        analysis.plot_ablation(rows, out / "ablation_delay.png")
        print(md)
    if compression:  # policies with ragged memory (DMS): achieved average memory and per-head eviction ratios
        (out / "compression.json").write_text(json.dumps(compression, indent=2) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {out}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
