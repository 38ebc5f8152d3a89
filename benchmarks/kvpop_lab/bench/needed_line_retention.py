"""How much of the lines an answer is made of a KVpop cache still holds when the prompt ends.

For each problem the prompt is prefilled into a KVpop cache loaded from a checkpoint (a distilled student's folder
holds the model too), and per layer and KV head we count the content tokens (names and values) of the *needed
lines* that are stored: the fact lines of a ``reasoning`` problem (``meta["fact_token_pos"]``: ``fact : x70 = 5 .``)
or the ``VAR`` statements of a ``vt`` problem (``meta["statement_token_pos"]``: ``VAR zibo = VAR krupodrim .``). StreamingLLM at the
same budget is the reference row. The answer's own later lines (rules, trace) are not counted.

    python benchmarks/needed_line_retention.py --model CKPT_DIR --out results/.../needed_lines.md \\
        --families reasoning,vt --n 8 --length 4096 --compression 0.88 --window 64 --knob reasoning.n_facts=10 \\
        --knob reasoning.steps=4

Prints and writes a markdown table with the command: the share of the needed content tokens stored and the share
of the needed lines whose content tokens are all stored, means over problems, layers and KV heads, and the head that
keeps the fewest such lines. The heads do not matter alike: per head, the dense model's *lookup attention* is the
share of the answer's lookup queries' attention that lands on the needed content tokens (teacher-forced; a lookup
query is the target's ``=`` after a fact name, whose next token copies the fact's value, for ``reasoning``, and every
target query for ``vt``; max over the query heads of a KV head, mean over the queries); the table also gives the
content tokens kept weighted by it, ``sum_h a_h kept_h / sum_h a_h``, and ``--per-head CSV`` writes both per
(family, policy, layer, head).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]

from kvpop_hf import KVpopCache  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_lab.testbed import make_problem  # noqa: E402
from kvpop_lab.testbed.qkv import record_qkv  # noqa: E402
from kvpop_lab.testbed.static_policies import served_at  # noqa: E402
from kvpop_lab.testbed.budget_args import add_budget_args, budgets_from_args  # noqa: E402
from kvpop_lab.testbed.evaluate import parse_knobs  # noqa: E402
from kvpop_lab.testbed.tasks import training_example  # noqa: E402
from kvpop_lab.utils.provenance import git_commit  # noqa: E402

LINE_STARTS = {"reasoning": "fact_token_pos", "vt": "statement_token_pos"}
# the words every such line repeats (``fact : x70 = 5 .``, ``VAR zibo = VAR krupodrim .``): not counted
STRUCTURE = frozenset({"fact", ":", "=", ".", "VAR"})


def needed_lines(problem, tokens: list[str], newline: str) -> list[list[int]]:
    """Per line that ``problem``'s answer needs, the positions of its content tokens (names, values: every token
    from the line's start to its newline that is not one of the STRUCTURE words)."""
    key = LINE_STARTS.get(problem.family)
    if key is None:
        raise ValueError(f"needed lines are defined for {sorted(LINE_STARTS)}, not {problem.family!r}")
    starts = problem.meta[key]
    if isinstance(starts, dict):  # reasoning: {fact tag: line start}
        flat = list(starts.values())
    else:  # vt: [[line start per hop] per chain]
        flat = [p for group in starts for p in group]
    out = []
    for p in sorted(flat):
        q, line = p, []
        while q < len(tokens) and tokens[q] != newline:
            if tokens[q] not in STRUCTURE:
                line.append(q)
            q += 1
        out.append(line)
    return out


@torch.no_grad()
def stored_after_prefill(model, cache, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill ``ids [1, S]`` into ``cache``; per layer the positions it stores, ``[kv_heads, B]``."""
    model(ids, **with_cache(model, cache))
    return [cache.stored_positions(layer)[0].cpu() for layer in range(len(cache.layers))]


def kept_share(stored: list[torch.Tensor], lines: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Given what a cache stores (:func:`stored_after_prefill`): ``[layers, kv_heads]`` share of the lines' content
    tokens it stores, and ``[layers, kv_heads]`` share of the lines whose content tokens it stores all."""
    tokens, whole = [], []
    for pos in stored:  # [h, B] per layer
        kept = [[torch.isin(torch.tensor(line), pos[h]) for line in lines] for h in range(pos.shape[0])]
        tokens.append(torch.stack([torch.cat(k).float().mean() for k in kept]))
        whole.append(torch.stack([torch.tensor([bool(x.all()) for x in k]).float().mean() for k in kept]))
    return torch.stack(tokens), torch.stack(whole)


#: the tokens of a reasoning fact line, in order (``fact : x70 = 5 .`` and its newline)
LINE_KINDS = ("fact", ":", "name", "=", "value", ".", "newline")


def fact_line_kinds(problem, tokens: list[str], newline: str) -> dict[str, list[int]]:
    """Positions of every fact line's tokens of a ``reasoning`` problem, by kind (:data:`LINE_KINDS`)."""
    out: dict[str, list[int]] = {k: [] for k in LINE_KINDS}
    for start in sorted(problem.meta["fact_token_pos"].values()):
        q, line = start, []
        while q < len(tokens) and tokens[q] != newline:
            line.append(q)
            q += 1
        if len(line) != len(LINE_KINDS) - 1:
            raise ValueError(f"a fact line of {len(line)} tokens at {start}; expected 'fact : NAME = VALUE .'")
        for kind, pos in zip(LINE_KINDS, line + [q]):
            out[kind].append(pos)
    return out


def lookup_queries(problem, full: list[int], n_prompt: int, tokenizer) -> list[int]:
    """Positions of the target's lookup queries in ``full`` (``<bos> prompt target <eos>``): for ``reasoning`` each
    ``=`` right after one of the problem's fact names (the next token copies that fact's value), otherwise every
    target position."""
    facts = problem.meta.get("facts") or {}
    if not facts:
        return list(range(n_prompt, len(full)))
    names = set(tokenizer.convert_tokens_to_ids(list(facts)))
    eq = tokenizer.convert_tokens_to_ids("=")
    return [t for t in range(max(1, n_prompt), len(full)) if full[t] == eq and full[t - 1] in names]


@torch.no_grad()
def lookup_attention(qkv: dict, queries: list[int], lines: list[list[int]]) -> torch.Tensor:
    """``qkv``: :func:`record_qkv` of a dense, teacher-forced sequence. Per layer and KV head, the share of the
    attention of the query positions ``queries`` on the lines' content tokens, max over the query heads of the KV
    head, mean over the queries -> ``[layers, kv_heads]``."""
    if not queries:
        raise ValueError("no lookup queries: the target has no position to measure")
    need = torch.tensor(sorted(p for line in lines for p in line))
    pos = torch.tensor(queries)
    S = next(iter(qkv.values()))[1].shape[2]  # keys [1, Hkv, S, D]
    out = []
    for layer in sorted(qkv):
        q, k, _, scale = qkv[layer]  # q [1, Hq, S, D], k [1, Hkv, S, D]
        Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
        T = len(queries)
        qt = q[0, :, pos].reshape(Hkv, Hq // Hkv, T, D)
        logits = scale * torch.einsum("hgtd,hsd->hgts", qt, k[0])  # [Hkv, G, T, S]
        causal = torch.arange(S)[None, :] > pos[:, None]  # [T, S]
        probs = logits.masked_fill(causal, float("-inf")).softmax(-1)
        out.append(probs[..., need].sum(-1).amax(1).mean(-1))  # [Hkv]
    return torch.stack(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a distilled student's folder (model + kvpop scorer)")
    ap.add_argument("--scorer-checkpoint", default=None, help="the KVpop checkpoint if not --model itself")
    ap.add_argument("--out", type=Path, required=True, help="markdown table to write")
    ap.add_argument("--families", default="reasoning,vt")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096)
    add_budget_args(ap, default="0.88")  # one budget: a ratio or a token count
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--seed-base", type=int, default=2 ** 48)
    ap.add_argument("--knob", action="append", default=[], help="generator knob FAMILY.KEY=VALUE (repeatable)")
    ap.add_argument("--per-head", type=Path, default=None, help="also write per-head shares to this CSV")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in LINE_STARTS]
    if bad:
        raise SystemExit(f"--families: needed lines are defined for {', '.join(sorted(LINE_STARTS))}; got {bad}")
    if args.n < 1:
        raise SystemExit(f"--n must be >= 1, got {args.n}")
    knobs = parse_knobs(args.knob, families)
    budgets = budgets_from_args(args, args.length, args.sinks, args.window)
    if len(budgets) != 1:
        raise SystemExit(f"needed_line_retention measures one budget; got {len(budgets)} "
                         f"({', '.join(b.spec for b in budgets)}): give one --compression ratio or one --budgets count")
    budget = budgets[0]

    from transformers import AutoTokenizer

    from kvpop_lab.testbed.models import load_model

    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model, torch.float32, "cpu")
    newline = tok.convert_ids_to_tokens(tok("a\nb", add_special_tokens=False)["input_ids"])[1]
    ckpt = args.scorer_checkpoint or args.model
    caches = {
        "kvpop": lambda: served_at(ckpt, model.config, sinks=args.sinks, window=args.window, topk=budget.topk),
        "streaming": lambda: KVpopCache(model.config, sinks=args.sinks, window=args.window, topk=budget.topk,
                                        scorer="streaming"),
    }
    rows, per_head, by_kind = [], [], []
    for fam in families:
        prompts = []  # (ids, needed lines, lookup attention [layers, heads]) of each problem, shared by the policies
        for i in range(args.n):
            problem = make_problem(fam, length=args.length, seed=args.seed_base + i, **knobs.get(fam, {}))
            ids = tok(problem.prompt)["input_ids"]
            full = training_example(problem, tok)["input_ids"]
            if full[:len(ids)] != ids:
                raise RuntimeError("the prompt's tokens differ inside the training example; positions would not match")
            words = tok.convert_ids_to_tokens(ids)
            lines = needed_lines(problem, words, newline)
            queries = lookup_queries(problem, full, len(ids), tok)
            qkv = record_qkv(model, torch.tensor([full]))
            kinds = fact_line_kinds(problem, words, newline) if fam == "reasoning" else {}
            kind_att = {k: lookup_attention(qkv, queries, [pos]) for k, pos in kinds.items()}
            prompts.append((ids, lines, lookup_attention(qkv, queries, lines), kinds, kind_att))
            del qkv
        att = torch.stack([p[2] for p in prompts]).mean(0)  # [layers, heads]
        for name, make in caches.items():
            tokens, whole, weighted = [], [], []
            kind_kept: dict[str, list] = {}
            for ids, lines, a, kinds, _ in prompts:
                stored = stored_after_prefill(model, make(), torch.tensor([ids]))
                t, w = kept_share(stored, lines)
                tokens.append(t)
                whole.append(w)
                weighted.append((a * t).sum() / a.sum().clamp_min(1e-12))
                for k, pos in kinds.items():
                    kind_kept.setdefault(k, []).append(kept_share(stored, [pos])[0])
            if kind_kept:
                ka = {k: torch.stack([p[4][k] for p in prompts]).mean(0) for k in kind_kept}  # [layers, heads]
                top = int(sum(ka.values()).argmax())
                lay, head = divmod(top, att.shape[1])
                for k, kept in kind_kept.items():
                    kk = torch.stack(kept).mean(0)
                    by_kind.append((fam, name, k, (lay, head), ka[k][lay, head].item(), kk[lay, head].item(),
                                    kk.mean().item(), ((ka[k] * kk).sum() / ka[k].sum().clamp_min(1e-12)).item()))
            t, w = torch.stack(tokens).mean(0), torch.stack(whole).mean(0)  # [layers, heads]
            rows.append((fam, name, len(lines), sum(map(len, lines)), t.mean().item(), w.mean().item(),
                         w.min().item(), divmod(int(w.argmin()), w.shape[1]), torch.stack(weighted).mean().item()))
            for layer in range(t.shape[0]):
                for head in range(t.shape[1]):
                    per_head.append((fam, name, layer, head, att[layer, head].item(), t[layer, head].item(),
                                     w[layer, head].item()))
            print(f"{fam} {name}: kept {t.mean().item():.3f} of the needed tokens, {w.mean().item():.3f} of the "
                  "needed lines whole", flush=True)
    commit = git_commit(ROOT)[:7]
    lines = [f"`python benchmarks/needed_line_retention.py {shlex.join(sys.argv[1:] if argv is None else argv)}` "
             f"(commit {commit}; B = {budget.B}, k = {budget.topk}; {args.n} problems per family, seeds "
             f"{args.seed_base} + i)", "",
             "| family | policy | needed lines / content tokens (last problem) | content tokens kept | lines kept whole | "
             "lines kept whole, lowest head (layer, head) | content tokens kept, weighted by lookup attention |",
             "|---|---|---|---|---|---|---|"]
    for fam, name, n_lines, n_tok, tok_share, whole, low, (lay, head), wtd in rows:
        lines.append(f"| {fam} | {name} | {n_lines} / {n_tok} | {tok_share:.3f} | {whole:.3f} | "
                     f"{low:.3f} (L{lay}, H{head}) | {wtd:.3f} |")
    if by_kind:
        lines += ["", "By token of the fact lines (reasoning): the lookup queries' attention on that token of every fact "
                  "line, in the head with the most lookup attention on the fact lines, and the share of those tokens "
                  "the cache stores there, on average over heads, and weighted over heads by that attention.", "",
                  "| policy | token | top lookup head | lookup attention there | kept there | kept, mean over heads | "
                  "kept, weighted by lookup attention |", "|---|---|---|---|---|---|---|"]
        for fam, name, k, (lay, head), a, kept_top, kept_mean, kept_w in by_kind:
            lines.append(f"| {name} | `{k}` | L{lay}, H{head} | {a:.3f} | {kept_top:.2f} | {kept_mean:.2f} | {kept_w:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.per_head is not None:
        args.per_head.parent.mkdir(parents=True, exist_ok=True)
        with open(args.per_head, "w") as fh:
            fh.write("family,policy,layer,head,lookup_attention,content_tokens_kept,lines_kept_whole\n")
            for fam, name, layer, head, a, t, w in per_head:
                fh.write(f"{fam},{name},{layer},{head},{a:.4f},{t:.4f},{w:.4f}\n")


if __name__ == "__main__":
    main()
