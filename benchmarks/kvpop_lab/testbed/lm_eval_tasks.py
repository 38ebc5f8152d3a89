"""The testbed and RULER-style families as lm-evaluation-harness tasks over local files.

``python -m kvpop_lab.testbed.lm_eval_tasks --out tasks/ --tokenizer Qwen/Qwen3-8B --families reasoning,vt --lengths
4096,16384 --n 40`` writes, per (family, length), ``kvpop_<family>_<length>.yaml`` and ``.jsonl`` (one problem a
line: ``prompt``, ``answer``, ``family``, ``seed``, ``n_tokens``), a group ``kvpop_testbed.yaml`` over all of them and
``utils.py`` (loads the jsonl beside it; scores with :func:`process_results`). Run them with
``lm-eval --include_path tasks/ --tasks kvpop_testbed ...``.

* Problems are those of ``kvpop-eval``: seeds ``seed_base + i`` (default ``2**48``) and the same ``--knob``s.
* Length: ``<bos> prompt target <eos>`` has at most ``length`` tokens of ``--tokenizer``. The generators count
  testbed-tokenizer tokens; for another tokenizer the generator's length is rescaled (a few regenerations) until the
  count in that tokenizer fits, so the problems of one seed differ between tokenizers but not between runs.
* Families: ``reasoning``, ``vt``, ``niah_multikey``, ``cwe``, ``fwe`` (:mod:`kvpop_lab.testbed.tasks`),
  ``niah_single`` (``niah_multikey`` with one needle, RULER's single needle), ``niah_multivalue`` and
  ``niah_multiquery`` (:mod:`kvpop_lab.testbed.ruler_tasks`; the answer lists the values, exact match on the list).
* Scoring: greedy ``generate_until`` to ``<eos>`` with ``max_gen_toks`` = the longest reference target of the task
  + 9 tokens (kvpop-eval's margin); the answer is read from the generation with
  :func:`~kvpop_lab.testbed.tokenizer.extract_answer` and compared with the normalized answer (kvpop-eval's exact
  match). With ``--repeats n`` (and ``--temperature``) each problem is sampled ``n`` times: ``exact_match`` is the
  mean over the ``n`` rollouts (pass@1 estimated from ``n``), ``pass_at_k`` is 1 when any rollout is right.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .tasks import make_problem
from .tokenizer import extract_answer, normalize

__all__ = ["EXPORT_FAMILIES", "export_tasks", "process_results", "load_jsonl", "fit_problem", "main"]

#: exported family -> (generator family, fixed knobs)
EXPORT_FAMILIES: dict[str, tuple[str, dict]] = {
    "reasoning": ("reasoning", {}),
    "vt": ("vt", {}),
    "niah_multikey": ("niah_multikey", {}),
    "niah_single": ("niah_multikey", {"num_needles": 1}),
    "niah_multivalue": ("niah_multivalue", {}),
    "niah_multiquery": ("niah_multiquery", {}),
    "cwe": ("cwe", {}),
    "fwe": ("fwe", {}),
}


_UTILS = '''"""Loader and metric of the kvpop testbed tasks (written by kvpop_lab.testbed.lm_eval_tasks)."""
from pathlib import Path

from kvpop_lab.testbed.lm_eval_tasks import load_jsonl, process_results  # noqa: F401


def load_docs(data_file, **_):
    return load_jsonl(Path(__file__).with_name(data_file))
'''


def load_jsonl(path: str | Path):
    """``{"test": Dataset}`` of one exported jsonl file."""
    import datasets

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list) -> dict:
    """kvpop-eval's exact match of one problem. ``results``: ``[text]`` (one generation) or ``[[text, ...]]``
    (the ``n`` rollouts kept by a ``take_first_k`` filter)."""
    outs = results[0] if results and isinstance(results[0], list) else results
    gold = normalize(doc["answer"])
    hits = [extract_answer(o) == gold for o in outs]
    return {"exact_match": sum(hits) / len(hits), "pass_at_k": float(any(hits))}


def _count(tokenizer, problem) -> int:
    """Tokens of ``<bos> prompt target <eos>`` in ``tokenizer`` (the testbed's length convention)."""
    return len(tokenizer(problem.prompt + problem.target, add_special_tokens=False)["input_ids"]) + 2


def fit_problem(family: str, length: int, seed: int, tokenizer, knobs: dict, tries: int = 6):
    """The problem of ``seed`` whose ``<bos> prompt target <eos>`` fits ``length`` tokens of ``tokenizer``, as long
    as the generator allows: the generator's own length first, then rescaled by the measured ratio."""
    gen, fixed = EXPORT_FAMILIES[family]
    kw = {**fixed, **knobs}
    glen, best = length, None
    for _ in range(tries):
        p = make_problem(gen, length=glen, seed=seed, **kw)
        n = _count(tokenizer, p)
        if n <= length and (best is None or n > best[1]):
            best = (p, n)
        if length - 8 <= n <= length:
            break
        nxt = max(64, int(glen * length / n) - (1 if n > length else 0))
        if nxt == glen:
            nxt = glen - 1 if n > length else glen + 1
        glen = nxt
    if best is None:
        raise ValueError(f"{family} at seed {seed}: no problem fits {length} tokens of this tokenizer "
                         f"(the shortest had {n}); use a larger --lengths value.")
    return best


def _yaml(task: str, data_file: str, max_gen_toks: int, repeats: int, temperature: float) -> str:
    sampled = temperature > 0
    gen = [f"  max_gen_toks: {max_gen_toks}", "  until: []", f"  do_sample: {'true' if sampled else 'false'}"]
    if sampled:
        gen.append(f"  temperature: {temperature}")
    metrics = "\n".join(f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true"
                        for m in ("exact_match", "pass_at_k"))
    return "\n".join([
        f"task: {task}",
        "custom_dataset: !function utils.load_docs",
        "dataset_kwargs:",
        f"  data_file: {data_file}",
        "test_split: test",
        "output_type: generate_until",
        "doc_to_text: prompt",
        "doc_to_target: answer",
        "process_results: !function utils.process_results",
        "generation_kwargs:", *gen,
        f"repeats: {repeats}",
        "filter_list:",
        "  - name: rollouts",
        "    filter:",
        "      - function: take_first_k",
        f"        k: {repeats}",
        "metric_list:", metrics,
        "metadata:",
        "  version: 1.0",
        ""])


def export_tasks(out: str | Path, tokenizer, families: Sequence[str], lengths: Sequence[int], n: int,
                 seed_base: int = 2 ** 48, knobs: dict[str, dict] | None = None, repeats: int = 1,
                 temperature: float = 0.0, group: str = "kvpop_testbed") -> list[str]:
    """Write the task files under ``out``; returns the task names. ``tokenizer``: a HF tokenizer (or a path)."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    bad = [f for f in families if f not in EXPORT_FAMILIES]
    if bad or not families:
        raise ValueError(f"unknown or no families {bad}; choose from {', '.join(EXPORT_FAMILIES)}.")
    if n < 1 or repeats < 1 or not lengths or min(lengths) < 64:
        raise ValueError("--n and --repeats must be >= 1 and every --lengths value >= 64.")
    if temperature < 0 or (repeats > 1 and temperature == 0):
        raise ValueError("--repeats > 1 samples: give --temperature > 0 (greedy rollouts would all be the same).")
    knobs = knobs or {}
    unknown = sorted(set(knobs) - set(families))
    if unknown:
        raise ValueError(f"--knob for families not exported: {unknown}.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "utils.py").write_text(_UTILS)
    names = []
    for fam in families:
        kn = dict(knobs.get(fam, {}))
        for length in lengths:
            task = f"{group}_{fam}_{length}" if group != "kvpop_testbed" else f"kvpop_{fam}_{length}"
            rows, gen_max = [], 0
            for i in range(n):
                seed = seed_base + i
                p, n_tok = fit_problem(fam, length, seed, tokenizer, kn)
                gen_max = max(gen_max, len(tokenizer(p.target, add_special_tokens=False)["input_ids"]) + 1)
                rows.append({"prompt": p.prompt, "answer": p.answer, "family": p.family, "seed": seed,
                             "n_tokens": n_tok})
            data = f"{task}.jsonl"
            (out / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
            (out / f"{task}.yaml").write_text(_yaml(task, data, gen_max + 8, repeats, temperature))
            names.append(task)
    (out / f"{group}.yaml").write_text("\n".join(
        [f"group: {group}", "task:", *[f"  - {t}" for t in names], "aggregate_metric_list:",
         "  - metric: exact_match", "    aggregation: mean", "    weight_by_size: false", "metadata:",
         "  version: 1.0", ""]))
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvpop_lab.testbed.lm_eval_tasks", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the task YAML, jsonl data and utils.py")
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder or Hub id the lengths are measured in")
    ap.add_argument("--families", default="reasoning,vt,niah_multikey",
                    help=f"comma list from {', '.join(EXPORT_FAMILIES)}")
    ap.add_argument("--lengths", default="4096", help="comma list of lengths in tokens of --tokenizer")
    ap.add_argument("--n", type=int, default=40, help="problems per family and length")
    ap.add_argument("--seed-base", type=int, default=2 ** 48, help="seed of problem i is seed_base + i (kvpop-eval's)")
    ap.add_argument("--knob", action="append", default=[], metavar="FAMILY.KEY=VALUE",
                    help="generator knob, as kvpop-eval --knob (e.g. reasoning.n_facts=10)")
    ap.add_argument("--repeats", type=int, default=1, help="rollouts per problem (pass@k); > 1 needs --temperature")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--group", default="kvpop_testbed", help="name of the group task over all exported tasks")
    return ap


def main(argv: list[str] | None = None) -> int:
    import ast

    args = build_parser().parse_args(argv)
    fams = [f.strip() for f in args.families.split(",") if f.strip()]
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--lengths expects integers, got {args.lengths!r}") from None
    knobs: dict[str, dict] = {}
    for item in args.knob:
        key, eq, val = item.partition("=")
        fam, dot, name = key.partition(".")
        if not eq or not dot or not name or fam not in EXPORT_FAMILIES:
            raise SystemExit(f"--knob expects FAMILY.KEY=VALUE with FAMILY one of {', '.join(EXPORT_FAMILIES)}, "
                             f"got {item!r}.")
        try:
            value = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            value = val
        knobs.setdefault(fam, {})[name.strip()] = value
    names = export_tasks(args.out, args.tokenizer, fams, lengths, args.n, args.seed_base, knobs, args.repeats,
                         args.temperature, args.group)
    print(f"wrote {len(names)} tasks to {args.out}: {', '.join(names)} (group {args.group})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
