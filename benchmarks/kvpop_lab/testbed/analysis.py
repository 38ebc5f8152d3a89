"""Analyses of ``kvpop-eval --analysis`` (KVpop arXiv:2607.05061):

* :func:`oracle_recall_rows`: oracle top-k recall per layer and KV head (paper Fig. 7). The dense model
  runs over ``<bos> prompt target <eos>`` while a recording attention
  function keeps the post-RoPE ``query [1, Hq, S, D]`` and ``key/value [1, Hkv, S, D]`` of every layer.
  Oracle priorities ``r* = future_attention_target(q, k, dense_causal_lse(q, k), window)`` ``[1, Hkv, S]``;
  scorer priorities ``p = sequence_priorities(scorer, layer, k, v, window, log_gamma, decay_step)``.
  With ``kept_x(q)`` the long-range tokens kept at query ``q`` by the running top-k of ``x``
  (:func:`kvpop_hf.ops.running_topk.running_topk`), the oracle top-k recall (:func:`oracle_topk_recall`) is the
  mean over queries of ``|kept_p(q) & kept_r*(q)| / |kept_r*(q)|``, counting every query where eviction
  happens (more than ``topk`` eligible tokens). Sinks and window are kept by both and not counted.
  (Training logs a different, cheaper signal, ``target_topk_recall``: see
  :func:`kvpop_hf.trainer.student.target_topk_recall`.)
* :func:`retention_map` / :func:`plot_retention`: which positions each (layer, KV head) still holds
  after greedy generation with a policy (paper Fig. 6), from ``cache.stored_positions(layer)``. By the
  cache contract this is exactly the running top-k kept set at the final query on the keys the
  policy actually saw (dense keys would differ from layer 1 on).
* :func:`ablation_delay`: delayed (``kvpop``) vs immediate (``kvpop_immediate``) scoring (Fig. 5).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from kvpop_hf.backends import Backends
from kvpop_hf.cache import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.ops.priority import decayed_priorities
from kvpop_hf.ops.running_topk import running_topk
from kvpop_hf.ops.priorities import sequence_priorities
from .models import load_model
from kvpop_hf.policies import POLICIES
from kvpop_hf.plotting import pyplot
from .qkv import record_qkv
from .report import averages
from .tasks import Problem, training_example

__all__ = ["record_qkv", "record_students", "cache_priorities", "oracle_topk_recall", "oracle_recall_shares", "oracle_recall_rows", "retention_map",
           "plot_retention", "ablation_delay", "heatmap_run", "run_all"]

def record_students(scored: Sequence[tuple], ids: torch.Tensor) -> dict[int, dict]:
    """:func:`record_qkv` of every distinct own model in ``scored`` (the 4th item of a ``(policy, budget, cache,
    own_model)`` tuple; ``None`` = the dense model), once each however many budgets share it: ``{id(model): qkv}``."""
    models = {id(m): m for *_, m in scored if m is not None}
    return {key: record_qkv(m, ids) for key, m in models.items()}


def cache_priorities(cache, layer: int, qkv: dict, device) -> torch.Tensor:
    """The static priorities ``[Hkv, S]`` that ``cache``'s scorer (with its ``log_gamma`` and decay step) gives the
    recorded keys and values ``qkv[layer]`` of one sequence (:func:`record_qkv`)."""
    cfg = cache.kvpop_config
    lg = cache.log_gamma[layer].to(device) if cache.log_gamma is not None else None
    _, k, v, _ = qkv[layer]
    return sequence_priorities(cache.scorer_for(device), layer, k, v, cfg.window, lg, cfg.decay_step)[0]


# -- oracle top-k recall -------------------------------------------------------------------------------------
def oracle_topk_recall(prio: torch.Tensor, oracle: torch.Tensor, sinks: int, window: int, topk: int,
                       chunk: int = 256, oracle_k: int | None = None, mass: bool = False) -> torch.Tensor:
    """prio/oracle ``[H, S]`` -> oracle top-k recall per head ``[H]`` (NaN if eviction never happens in
    ``S`` tokens).

    ``oracle_k`` (default ``topk``): recall of the oracle's ``oracle_k`` best eligible tokens at each query (its
    running top-``oracle_k``) within the ``topk`` that ``prio`` keeps, e.g. of the few tokens the future attends to
    most. ``mass=True``: instead of counting tokens, weigh each by ``exp(oracle)`` (the oracle is a log future
    attention), i.e. the share of the oracle's kept attention that ``prio``'s kept set holds."""
    return oracle_recall_shares(prio, oracle, sinks, window, topk, [(topk if oracle_k is None else oracle_k, mass)],
                                chunk)[0]


def oracle_recall_shares(prio: torch.Tensor, oracle: torch.Tensor, sinks: int, window: int, topk: int,
                         shares: Sequence[tuple[int, bool]], chunk: int = 256) -> torch.Tensor:
    """Several :func:`oracle_topk_recall` measures in one pass: ``shares`` lists ``(oracle_k, mass)`` pairs;
    returns ``[len(shares), H]``. The running top-k of ``prio``, and of the oracle once per distinct ``oracle_k``,
    are computed once for all of them."""
    H, S = oracle.shape
    rs = running_topk(prio.float(), sinks, window, topk)
    ro = {k: running_topk(oracle.float(), sinks, window, k) for k in dict.fromkeys(k for k, _ in shares)}
    weight = None
    if any(m for _, m in shares):
        weight = (oracle.double() - oracle.double().amax(-1, keepdim=True)).exp()[:, None, :]
    t = torch.arange(S, device=oracle.device)
    num = torch.zeros(len(shares), H, dtype=torch.float64, device=oracle.device)
    cnt = torch.zeros(len(shares), H, dtype=torch.float64, device=oracle.device)
    for q0 in range(0, S, chunk):
        q = torch.arange(q0, min(S, q0 + chunk), device=oracle.device)
        elig = (t[None, :] >= sinks) & (t[None, :] <= q[:, None] - window)  # [c, S]
        ks = elig & (rs.rank[:, None, :] <= rs.cutoff[:, q, None])  # [H, c, S]
        active = (elig.sum(-1) > topk)[None, :].expand(H, -1)  # eviction happens at these queries
        for i, (k, mass) in enumerate(shares):
            ko = elig & (ro[k].rank[:, None, :] <= ro[k].cutoff[:, q, None])
            if mass:
                denom = (ko * weight).sum(-1)
                ratio = ((ko & ks) * weight).sum(-1) / denom.clamp_min(1e-300)
            else:
                denom = ko.sum(-1).double()
                ratio = (ko & ks).sum(-1).double() / denom.clamp_min(1)
            use = active & (denom > 0)
            num[i] += torch.where(use, ratio, torch.zeros_like(ratio)).sum(-1)
            cnt[i] += use.sum(-1).double()
    return torch.where(cnt > 0, num / cnt.clamp_min(1), torch.full_like(num, float("nan")))


@torch.no_grad()
def oracle_recall_rows(model, tokenizer, problems: Sequence[Problem], scored: Sequence[tuple[str, Any, Any]],
                progress: bool = True, kind: str = "mean", queries: str = "all", oracle_ks: Sequence[int] = (),
                mass: bool = False, oracle_decay: bool = False) -> list[dict]:
    """Oracle top-k recall per (policy, budget, layer, KV head), averaged over ``problems``.

    ``oracle_ks``: also the recall of the oracle's best ``m`` eligible tokens for each ``m`` (columns
    ``oracle_recall_top<m>``); ``mass``: also the share of the oracle's kept attention (column ``oracle_mass``);
    see :func:`oracle_topk_recall`.

    The oracle is :func:`kvpop_lab.testbed.oracle.oracle_table`: ``kind`` ``"mean"`` (the paper's target) or
    ``"max"`` future attention, from every later query (``queries="all"``) or only from those that generate
    the reference answer (``"target"``). ``oracle_decay``: the oracle's running top-k is taken over the oracle with
    each policy's own recency decay added (its ``log_gamma`` and decay step, none for a policy without one), i.e.
    the teacher's decisions under the decayed target of the paper's Eq. 5, which its training matches.

    scored: ``(policy, budget, cache)`` triples, or ``(policy, budget, cache, own_model)``; the cache supplies the
    scorer, ``log_gamma`` and the budget (``sinks/window/topk`` of its ``kvpop_config``). Oracle priorities use the
    same window. A policy with its own model (a distilled student) scores that model's keys and values, and is
    compared with ``model``'s oracle: the tokens the dense model needs. Attention-based policies (TOVA, H2O,
    SnapKV) have no static priority and get no rows.
    """
    device = next(model.parameters()).device
    acc: dict[tuple, list[torch.Tensor]] = {}
    backend = Backends.defaults(device, ("target_pass",)).target_pass
    it = problems
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(problems, desc="oracle recall", leave=False)
    from .oracle import oracle_table_from_qkv, target_queries

    if queries not in ("all", "target"):
        raise ValueError(f"queries must be 'all' or 'target', got {queries!r}")
    if oracle_decay and mass:
        raise ValueError("mass=True weighs tokens by the undecayed oracle's attention; it is not defined with "
                         "oracle_decay=True: ask for one of them")
    scored = [tuple(s) + (None,) * (4 - len(s)) for s in scored]
    for p in it:
        ex = training_example(p, tokenizer)
        ids = torch.tensor([ex["input_ids"]], device=device)
        qmask = target_queries(torch.tensor([ex["labels"]], device=device)) if queries == "target" else None
        qkv = record_qkv(model, ids)
        own_qkv = record_students(scored, ids)  # each student's own keys/values
        oracles: dict[int, torch.Tensor] = {}  # window -> [num_layers, Hkv, S]
        for layer in sorted(qkv):
            for policy, budget, cache, own in scored:
                if cache.scorer.dynamic:
                    continue  # TOVA/H2O/SnapKV: no static priority to rank the sequence with
                cfg = cache.kvpop_config
                if cfg.window not in oracles:
                    oracles[cfg.window] = oracle_table_from_qkv(qkv, cfg.window, backend=backend, kind=kind,
                                                                query_mask=qmask).to(device)
                prio = cache_priorities(cache, layer, qkv if own is None else own_qkv[id(own)], device)
                shares = [(cfg.topk, False)] + [(m, False) for m in oracle_ks] + ([(cfg.topk, True)] if mass else [])
                oracle = oracles[cfg.window][layer]  # [Hkv, S]
                if oracle_decay and cache.log_gamma is not None:
                    pos = torch.arange(oracle.shape[-1], device=device)
                    oracle = decayed_priorities(oracle[None], pos, cache.log_gamma[layer].to(device), cfg.decay_step)[0]
                recs = oracle_recall_shares(prio, oracle, cfg.sinks, cfg.window, cfg.topk, shares)
                acc.setdefault((policy, budget.B, round(budget.cr, 4), layer), []).append(recs.cpu())
    names = ["oracle_recall"] + [f"oracle_recall_top{m}" for m in oracle_ks] + (["oracle_mass"] if mass else [])
    rows = []
    for (policy, B, cr, layer), recs in acc.items():
        r = torch.stack(recs).nanmean(0)  # [metrics, H]
        for h in range(r.shape[1]):
            row = {"policy": policy, "budget": B, "cr": cr, "layer": layer, "head": h}
            row.update({name: r[i, h].item() for i, name in enumerate(names)})
            row["n_problems"] = len(recs)
            rows.append(row)
    return rows


def write_oracle_recall(rows: Sequence[dict], csv_path: Path, png_path: Path) -> None:
    with open(csv_path, "w", newline="") as fh:
        fields = list(rows[0]) if rows else ["policy", "budget", "cr", "layer", "head", "oracle_recall", "n_problems"]
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    plt = pyplot(png_path)
    if plt is None:
        return

    lines: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        lines.setdefault((r["policy"], r["budget"], r["cr"]), {}).setdefault(r["layer"], []).append(r["oracle_recall"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for (p, B, cr), by_layer in lines.items():
        xs = sorted(by_layer)
        if all(math.isnan(x) for ys in by_layer.values() for x in ys):
            continue  # budget never evicts at this length
        ax.plot(xs, [_nanmean(by_layer[x]) for x in xs], marker="o", label=f"{p} B={B} (cr {cr:.2f})")
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("oracle top-k recall (mean over KV heads)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _nanmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


# -- retention heatmap ------------------------------------------------------------------------------------
EVICTED, SINK, WINDOW, TOPK = 0, 1, 2, 3


def retention_map(cache, n_tokens: int) -> torch.Tensor:
    """``[layers * kv_heads, n_tokens]`` int8 from ``cache.stored_positions`` (batch row 0):
    0 evicted, 1 sink, 2 recent window, 3 long-range token kept by the scorer. ``n_tokens`` = tokens the
    cache has seen."""
    cfg = cache.kvpop_config
    rows = []
    for layer in range(len(cache.layers)):
        pos = cache.stored_positions(layer)[0].cpu()  # [h, B]
        m = torch.zeros(pos.shape[0], n_tokens, dtype=torch.int8)
        for h in range(pos.shape[0]):
            p = pos[h][(pos[h] >= 0) & (pos[h] < n_tokens)]
            m[h, p] = TOPK
        m[:, : cfg.sinks] = torch.where(m[:, : cfg.sinks] > 0, SINK, EVICTED).to(torch.int8)
        w0 = max(n_tokens - cfg.window, 0)
        m[:, w0:] = torch.where(m[:, w0:] > 0, WINDOW, EVICTED).to(torch.int8)
        rows.append(m)
    return torch.cat(rows, 0)


def plot_retention(mat: torch.Tensor, kv_heads: int, path: Path, title: str, marks: dict | None = None) -> None:
    """Image of :func:`retention_map` (rows = (layer, head), columns = positions); ``marks``:
    ``{label: [positions]}`` drawn as ticks above the image (e.g. fact lines of a reasoning problem)."""
    plt = pyplot(path)
    if plt is None:
        return
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colors = ["#f4f4f4", "#7f7f7f", "#9ecae1", "#d62728"]
    cmap = ListedColormap(colors)
    R, T = mat.shape
    fig, ax = plt.subplots(figsize=(12, max(2.5, 0.25 * R + 1.5)))
    ax.imshow(mat.numpy(), aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
    ax.set_yticks(range(R))
    ax.set_yticklabels([f"L{r // kv_heads} H{r % kv_heads}" for r in range(R)], fontsize=6)
    ax.set_xlabel("token position")
    for i, (label, xs) in enumerate((marks or {}).items()):
        for x in xs:
            ax.axvline(x, color=["k", "g", "m"][i % 3], lw=1.0, ls="--" if i else "-", alpha=0.9)
    handles = [Patch(color=c, label=n) for c, n in zip(colors, ["evicted", "sink", "window", "kept (top-k)"])]
    handles += [Patch(color=["k", "g", "m"][i % 3], label=label) for i, label in enumerate(marks or {})]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


@torch.no_grad()
def retention_after_generation(model, tokenizer, problem: Problem, cache) -> tuple[torch.Tensor, int, str]:
    """Greedy generation of ``problem`` with ``cache``; returns (retention map, tokens seen, generated text)."""
    from .tokenizer import count_tokens

    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer(problem.prompt)["input_ids"]], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache),
                         max_new_tokens=count_tokens(problem.target) + 9, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    n_seen = int(cache.layers[0].get_seq_length())  # the last generated token is never fed back
    text = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return retention_map(cache, n_seen), n_seen, text


# -- delay ablation -----------------------------------------------------------------------------------------
def ablation_delay(rows: Sequence[dict], oracle_recall: Sequence[dict] | None = None) -> str | None:
    """Markdown comparing ``kvpop`` (delayed) with ``kvpop_immediate`` per budget (None if either is missing):
    average EM and token accuracy over all families, and the mean oracle top-k recall when available."""
    fams = sorted({r["family"] for r in rows})
    av = averages(rows, fams)
    budgets = sorted({b for (p, b) in av if p == "kvpop"} & {b for (p, b) in av if p == "kvpop_immediate"})
    if not budgets:
        return None
    rec: dict[tuple, list[float]] = {}
    for r in oracle_recall or []:
        rec.setdefault((r["policy"], r["budget"]), []).append(r["oracle_recall"])
    lines = ["## Delayed vs immediate scoring (paper Fig. 5)", "",
             "| B | cr | EM delayed | EM immediate | tok acc delayed | tok acc immediate | Δ tok acc | "
             "oracle recall delayed | oracle recall immediate |", "|---|---|---|---|---|---|---|---|---|"]
    for B in budgets:
        d, i = av[("kvpop", B)], av[("kvpop_immediate", B)]
        rd, ri = _nanmean(rec.get(("kvpop", B), [])), _nanmean(rec.get(("kvpop_immediate", B), []))
        lines.append(f"| {B} | {d['cr']:.3f} | {d['avg_em']:.3f} | {i['avg_em']:.3f} | {d['avg_acc']:.3f} | "
                     f"{i['avg_acc']:.3f} | {d['avg_acc'] - i['avg_acc']:+.3f} | {rd:.3f} | {ri:.3f} |")
    lines += ["", f"Averages over {', '.join(fams)}; oracle top-k recall: mean over layers, KV heads (n/a = nan if "
                  "--analysis was off).", ""]
    return "\n".join(lines)


def plot_ablation(rows: Sequence[dict], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fams = sorted({r["family"] for r in rows})
    av = averages(rows, fams)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for p, label in (("kvpop", "delayed"), ("kvpop_immediate", "immediate")):
        pts = sorted((d["cr"], d["avg_acc"]) for (q, b), d in av.items() if q == p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{p} ({label})")
    ax.set_xlabel("compression ratio")
    ax.set_ylabel("avg token accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- driver -----------------------------------------------------------------------------------------------
_HEATMAP_PREFERENCE = ("kvpop_distill", "kvpop", "kvpop_mlp_distill", "kvpop_mlp", "kvpop_immediate", "knorm",
                       "random", "streaming")


def heatmap_run(runs, rows: Sequence[dict] | None = None):
    """The run whose retention map is drawn: at the highest compression among ``runs``, the policy with the best
    exact match there (``rows`` of kvpop-eval, reasoning family), ties and missing rows by
    :data:`_HEATMAP_PREFERENCE`."""
    order = {p: i for i, p in enumerate(_HEATMAP_PREFERENCE)}
    top_cr = max(r.budget.cr for r in runs)
    em = {}
    for row in rows or ():
        if row.get("family") == "reasoning" and row.get("em") == row.get("em"):  # not NaN
            em[(row["policy"], row["budget"])] = row["em"]
    at_top = [r for r in runs if r.budget.cr == top_cr]
    return max(at_top, key=lambda r: (em.get((r.policy, r.budget.B), -1.0), -order.get(r.policy, len(order))))


def run_all(model, tokenizer, plan, out: Path, args, progress: bool = True,
            rows: Sequence[dict] | None = None, students=None) -> tuple[dict, list[dict]]:
    """Write ``recall_per_layer.csv/png`` and ``retention_heatmap.png`` on the first ``args.analysis_n``
    reasoning problems; returns (summary for ``meta.json``, oracle recall rows). Learned scorers with their own
    weights (``kvpop_distill``, ``kvpop_mlp_distill``) get recall rows for the keys and values of their model against
    ``model``'s oracle, and generate with their own model for the heatmap; the other policies with their own weights
    (``streaming_plus``: no long-range slots, ``dms``: no ranking) get neither. The heatmap shows the best policy
    by exact match (``rows``) at the highest compression (:func:`heatmap_run`). ``students``: the evaluation's
    :class:`~kvpop_lab.testbed.models.LastModel`, which loads the students (its held one is not loaded again)."""
    problems = plan.problems["reasoning"][: args.analysis_n]
    evict = [r for r in plan.runs if r.budget is not None and not r.own_model]
    own_runs = [r for r in plan.runs if r.budget is not None and r.own_model and isinstance(r.prototype, KVpopCache)
                and not POLICIES[r.policy].window_only]
    summary: dict = {"problems": [p.meta.get("n_tokens") for p in problems],
                     "seeds": plan.seeds["reasoning"][: args.analysis_n]}
    if not evict and not own_runs:
        summary["skipped"] = "no eviction policy in this run"
        return summary, []
    scored = [(r.policy, r.budget, r.factory()(model.config)) for r in evict]
    loaded: dict[str, Any] = {}  # checkpoint -> its model, loaded once for all budgets
    device = next(model.parameters()).device
    load = students.get if students is not None else (lambda path: load_model(path, model.dtype, device))
    for r in own_runs:
        if r.checkpoint not in loaded:
            loaded[r.checkpoint] = load(r.checkpoint)
        own = loaded[r.checkpoint]
        scored.append((r.policy, r.budget, r.factory()(own.config), own))
    rec = oracle_recall_rows(model, tokenizer, problems, scored, progress=progress,
                             kind=getattr(args, "oracle_kind", "mean"), queries=getattr(args, "oracle_queries", "all"))
    scored.clear()
    write_oracle_recall(rec, out / "recall_per_layer.csv", out / "recall_per_layer.png")

    run = heatmap_run(evict + own_runs, rows)
    run_model = loaded[run.checkpoint] if run.own_model else model
    loaded.clear()  # the other students' weights
    cache = run.factory()(run_model.config)
    mat, n_seen, text = retention_after_generation(run_model, tokenizer, problems[0], cache)
    del run_model
    meta = problems[0].meta
    start = len(tokenizer(problems[0].prompt)["input_ids"])  # <bos> + prompt under *this* tokenizer
    marks = {}
    if meta.get("target_token_start") == start:  # meta positions are in testbed-tokenizer tokens
        marks["fact lines"] = sorted(meta.get("fact_token_pos", {}).values())
    marks["target start"] = [start]
    cfg = cache.kvpop_config
    plot_retention(mat, cfg.num_kv_heads, out / "retention_heatmap.png",
                   f"{run.policy}  B={run.budget.B} (s={cfg.sinks}, w={cfg.window}, k={cfg.topk}), "
                   f"reasoning seed {plan.seeds['reasoning'][0]}, {n_seen} tokens seen", marks)
    summary["heatmap"] = {"policy": run.policy, "budget": run.budget.B, "tokens_seen": n_seen,
                          "generated": text}
    return summary, rec
