"""Leave-families-out retrofits: does a scorer retrofitted on some task families keep the answers of the others?

The teacher knows every family of the plan (``benchmarks/gpu/many_family_teacher.sh``); KVpop and DMS are retrofitted
on the first ``k`` families of ``--order`` (k = 1, 2, 4 by default; the same seconds and steps at every k; two seeds)
and evaluated, beside SnapKV, StreamingLLM and dense, on every family, above all on the held-out ones (those not in
the retrofit data). ``benchmarks/gpu/leave_families_out.sh`` runs it; this module holds its bookkeeping:

* ``plan``: check the split and write ``WORK/plan.json`` (before any work); ``split``: one split's families, for
  the shell;
* ``train KIND ARGS...``: ``kvpop_hf.cli.retrofit`` (KIND ``kvpop``) or ``kvpop_hf.cli.train_dms`` (``dms``) with
  ARGS, then ``lfo_training.json`` (steps, training seconds) written into the run's ``--output_dir``;
* ``table WORK --out DIR``: the tables and the curve (below); ``teacher EVAL_DIR... --out DIR``: the teacher's dense
  EM per family.

Layout of WORK (the contract between the driver and the table builder):

    plan.json                               the split, lengths, compressions, seeds, steps, seconds
    baselines/<any>/                        kvpop-eval folders of the policies trained on nothing (dense, SnapKV, ...)
    k<k>/ckpt_s<seed>/<policy>_cr<NN>/      checkpoints, each with lfo_training.json
    k<k>/eval_<name>_s<seed>/               kvpop-eval folders of the learned policies of retrofit seed <seed>

Statistics. A policy run on ``n`` problems of a family: ``EM`` and its binomial SE ``sqrt(EM (1 - EM) / n)``. A
learned policy over ``S`` retrofit seeds (the same ``n`` problems): ``EM`` = the mean over seeds; ``se_seeds`` =
the sample SD of the seeds' EMs / sqrt(S) (0 for one seed); ``se_problems`` = ``sqrt(EM (1 - EM) / n)`` (the problems
are shared, so their sampling error does not shrink with S); ``se = sqrt(se_seeds^2 + se_problems^2)`` (conservative).
``ratio`` = EM / dense EM of the family, ``ratio_se`` = se / dense EM. A curve point (policy, compression, k) is the
mean over the families held out at every k of the plan (the common held-out set), its SE ``sqrt(sum se_f^2) / F``.
The verdict: per compression, the smallest k at which KVpop keeps >= 0.9 of dense on a held-out family (seed mean),
and which families.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from kvpop_lab.bench.eval_table import rows_of
from kvpop_lab.utils.provenance import git_commit

FAMILIES = ("reasoning", "vt", "niah_multikey", "niah_multivalue", "niah_multiquery", "fwe")
ORDER = ("reasoning", "vt", "niah_multikey", "fwe")
KS = (1, 2, 4)
THRESHOLD = 0.9
KVPOP = "kvpop_distill"
LABELS = {"kvpop_distill": "KVpop", "dms": "DMS", "snapkv": "SnapKV", "streaming": "StreamingLLM", "dense": "dense"}
RECORD = "lfo_training.json"


# -- the plan ------------------------------------------------------------------------------------------------------
def make_plan(families=FAMILIES, order=ORDER, ks=KS, **settings) -> dict:
    """The split: retrofit families of ``k`` = ``order[:k]``, held out = the other ``families``. Raises ValueError
    on an unknown or repeated family, an ``order`` family outside ``families``, ``ks`` not increasing from >= 1,
    a ``k`` above ``len(order)``, or no family held out at the largest ``k``. ``settings`` are stored as given."""
    from kvpop_lab.testbed import ALL_FAMILIES, DRILLS

    families, order, ks = list(families), list(order), [int(k) for k in ks]
    for name, names in (("--families", families), ("--order", order)):
        bad = [f for f in names if f not in ALL_FAMILIES or f in DRILLS]
        if bad:
            raise ValueError(f"{name}: unknown family {', '.join(bad)} (testbed families: "
                             f"{', '.join(f for f in ALL_FAMILIES if f not in DRILLS)}; the drills "
                             "train teachers only)")
        if len(set(names)) != len(names):
            raise ValueError(f"{name} names a family twice: {','.join(names)}")
    outside = [f for f in order if f not in families]
    if outside:
        raise ValueError(f"--order family {', '.join(outside)} is not among --families: the teacher must know it")
    if not ks or ks[0] < 1 or any(b <= a for a, b in zip(ks, ks[1:])):
        raise ValueError(f"--ks must increase from >= 1 (e.g. 1,2,4), got {','.join(map(str, ks)) or 'nothing'}")
    if ks[-1] > len(order):
        raise ValueError(f"--ks goes to {ks[-1]} retrofit families but --order lists {len(order)}")
    common = [f for f in families if f not in order[:ks[-1]]]
    if not common:
        raise ValueError(f"with {ks[-1]} retrofit families no family is held out: add families or lower --ks")
    splits = {str(k): {"retrofit": order[:k], "heldout": [f for f in families if f not in order[:k]]} for k in ks}
    return {"families": families, "order": order, "ks": ks, "splits": splits, "common_heldout": common, **settings}


def load_plan(work: Path) -> dict:
    path = Path(work) / "plan.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run the driver's STAGE=plan (or `leave_families_out plan`) first")
    return json.loads(path.read_text())


# -- training ------------------------------------------------------------------------------------------------------
def train(kind: str, argv: list[str]) -> dict:
    """Train with ``kvpop_hf.cli.retrofit`` (``kvpop``) or ``kvpop_hf.cli.train_dms`` (``dms``) on ``argv`` and write
    ``lfo_training.json`` (``steps``, ``train_seconds``, ``kind``, ``argv``) into the run's output folder."""
    if kind == "kvpop":
        from kvpop_hf.cli.retrofit import train as run
    elif kind == "dms":
        from kvpop_hf.cli.train_dms import train as run
    else:
        raise SystemExit(f"train: KIND must be kvpop or dms, got {kind!r}")
    from kvpop_hf.cli.common import run_cli

    done = []
    run_cli(lambda a: done.append(run(a)), argv)
    trainer = done[0]
    seconds = next((h["train_runtime"] for h in reversed(trainer.state.log_history) if "train_runtime" in h), None)
    record = {"kind": kind, "steps": trainer.state.global_step, "train_seconds": seconds, "argv": argv,
              "git_commit": git_commit()}
    out = Path(trainer.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


# -- reading the evaluations ---------------------------------------------------------------------------------------
def _compression(budget: str, length: int) -> float | None:
    return None if budget == "full" else round(1 - int(budget) / length, 2)


def _folder_rows(folder: Path, families, length: int) -> list[dict]:
    out = []
    for fam in families:
        for r in rows_of(folder, fam):
            out.append({"policy": r["policy"], "compression": _compression(r["budget"], length), "family": fam,
                        "em": r["em"], "n": r["n"]})
    return out


def _training(work: Path, k: int, seed: int, policy: str, compression: float) -> dict:
    f = work / f"k{k}" / f"ckpt_s{seed}" / f"{policy}_cr{round(compression * 100)}" / RECORD
    return json.loads(f.read_text()) if f.is_file() else {}


def collect(work: Path, plan: dict) -> tuple[list[dict], list[dict]]:
    """``(baselines, learned)``: one row per (policy, compression, family) of ``baselines/*/`` and per (policy,
    compression, k, seed, family) of ``k<k>/eval_*_s<seed>/`` (with ``heldout``, ``steps``, ``train_seconds``)."""
    work, length, families = Path(work), int(plan["length"]), plan["families"]
    baselines, seen = [], set()
    for folder in sorted(p for p in (work / "baselines").glob("*") if p.is_dir()):
        for r in _folder_rows(folder, families, length):
            key = (r["policy"], r["compression"], r["family"])
            if key not in seen:  # a row of an earlier folder wins
                seen.add(key)
                baselines.append(r)
    learned = []
    for k in plan["ks"]:
        retrofit = plan["splits"][str(k)]["retrofit"]
        for folder in sorted((work / f"k{k}").glob("eval_*_s*")):
            m = re.fullmatch(r"eval_.+_s(\d+)", folder.name)
            if not m or not folder.is_dir():
                continue
            seed = int(m.group(1))
            for r in _folder_rows(folder, families, length):
                if r["policy"] == "dense" or r["compression"] is None:
                    continue
                rec = _training(work, k, seed, r["policy"], r["compression"])
                learned.append({**r, "k": k, "seed": seed, "heldout": r["family"] not in retrofit,
                                "steps": rec.get("steps", ""), "train_seconds": rec.get("train_seconds", "")})
    return baselines, learned


# -- statistics ----------------------------------------------------------------------------------------------------
def binomial_se(em: float, n: int) -> float:
    return math.sqrt(max(em * (1 - em), 0.0) / n) if n else math.nan


def seed_mean(ems: list[float], n: int) -> dict:
    """EM over retrofit seeds on the same ``n`` problems: ``em``, ``se_seeds``, ``se_problems``, ``se`` (module
    docstring)."""
    s = len(ems)
    em = sum(ems) / s
    se_seeds = math.sqrt(sum((e - em) ** 2 for e in ems) / (s - 1) / s) if s > 1 else 0.0
    se_problems = binomial_se(em, n)
    return {"em": em, "se_seeds": se_seeds, "se_problems": se_problems, "se": math.hypot(se_seeds, se_problems),
            "n_seeds": s}


def aggregate(baselines: list[dict], learned: list[dict], plan: dict) -> list[dict]:
    """One row per (policy, compression, k, family): the baselines' (k empty, one run) and the learned policies'
    seed means, each with ``dense_em``, ``ratio`` and ``ratio_se``."""
    dense = {r["family"]: r["em"] for r in baselines if r["policy"] == "dense"}
    rows = []
    for r in baselines:
        se = binomial_se(r["em"], r["n"])
        rows.append({"policy": r["policy"], "compression": r["compression"], "k": "", "family": r["family"],
                     "heldout": "", "n": r["n"], "n_seeds": 1, "em": r["em"], "se_seeds": 0.0, "se_problems": se,
                     "se": se, "seeds": "", "steps": ""})
    groups = defaultdict(list)
    for r in learned:
        groups[(r["policy"], r["compression"], r["k"], r["family"])].append(r)
    for (policy, comp, k, fam), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                               plan["families"].index(kv[0][3]))):
        ns = {r["n"] for r in rs}
        if len(ns) > 1:
            raise SystemExit(f"{policy} at {comp}, k={k}, {fam}: the seeds ran on different numbers of problems "
                             f"{sorted(ns)}; evaluate every seed on the same problems")
        stats = seed_mean([r["em"] for r in sorted(rs, key=lambda r: r["seed"])], rs[0]["n"])
        rows.append({"policy": policy, "compression": comp, "k": k, "family": fam, "heldout": rs[0]["heldout"],
                     "n": rs[0]["n"], **stats, "seeds": " ".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"])),
                     "steps": " ".join(str(r["steps"]) for r in sorted(rs, key=lambda r: r["seed"]))})
    for r in rows:
        d = dense.get(r["family"])
        r["dense_em"] = "" if d is None else d
        r["ratio"] = r["em"] / d if d else math.nan
        r["ratio_se"] = r["se"] / d if d else math.nan
    return rows


def curve(rows: list[dict], plan: dict) -> list[dict]:
    """Held-out EM vs the number of retrofit families: per (policy, compression, k) the mean over the common held-out
    families (all of them present, else no point), beside each baseline's mean over the same families (k empty)."""
    common = plan["common_heldout"]
    by = defaultdict(dict)
    for r in rows:
        if r["compression"] is None and r["policy"] != "dense":
            continue
        if r["family"] in common:
            by[(r["policy"], r["compression"], r["k"])][r["family"]] = r
    dense = by.get(("dense", None, ""), {})
    points = []
    for (policy, comp, k), fams in by.items():
        if set(fams) != set(common):
            continue
        em = sum(fams[f]["em"] for f in common) / len(common)
        se = math.sqrt(sum(fams[f]["se"] ** 2 for f in common)) / len(common)
        d = sum(dense[f]["em"] for f in common) / len(common) if set(dense) == set(common) else math.nan
        points.append({"policy": policy, "compression": comp, "k": k, "families": ",".join(common), "em": em,
                       "se": se, "dense_em": d, "ratio": em / d if d else math.nan})
    points.sort(key=lambda p: (p["policy"], p["compression"] or 0, p["k"] if p["k"] != "" else -1))
    return points


def verdict(rows: list[dict], plan: dict, policy: str = KVPOP, threshold: float = THRESHOLD) -> list[dict]:
    """Per compression: ``reached_at_k`` (the smallest k at which ``policy`` keeps >= ``threshold`` of dense on a
    held-out family, None if none), the families there, and every (k, family, ratio) that reaches it."""
    comps = sorted({r["compression"] for r in rows if r["policy"] == policy})
    out = []
    for comp in comps:
        hits = [r for r in rows if r["policy"] == policy and r["compression"] == comp and r["heldout"] is True
                and not math.isnan(r["ratio"]) and r["ratio"] >= threshold]
        hits.sort(key=lambda r: (r["k"], plan["families"].index(r["family"])))
        first = hits[0]["k"] if hits else None
        out.append({"policy": policy, "compression": comp, "threshold": threshold, "reached_at_k": first,
                    "families_at_k": [r["family"] for r in hits if r["k"] == first],
                    "all": [(r["k"], r["family"], round(r["ratio"], 4)) for r in hits]})
    return out


# -- writing -------------------------------------------------------------------------------------------------------
def _fmt(v):
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4f}"
    return "" if v is None else v


def write_csv(rows: list[dict], path: Path) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c)) for c in cols})


def plot_curve(points: list[dict], plan: dict, path: Path) -> None:
    """One panel per compression: EM on the common held-out families against k, learned policies as lines with
    SE bars, the baselines (and dense) as horizontal lines."""
    from kvpop_hf.plotting import line_styles, pyplot

    plt = pyplot(path)
    if plt is None:
        return
    comps = sorted({p["compression"] for p in points if p["compression"] is not None})
    policies = sorted({p["policy"] for p in points})
    styles = line_styles(policies)
    fig, axes = plt.subplots(1, max(1, len(comps)), figsize=(5 * max(1, len(comps)), 4), squeeze=False)
    for ax, comp in zip(axes[0], comps or [None]):
        for pol in policies:
            pts = [p for p in points if p["policy"] == pol and p["compression"] in (comp, None)]
            label = LABELS.get(pol, pol)
            if any(p["k"] == "" for p in pts):  # trained on nothing: flat
                p = pts[0]
                ax.axhline(p["em"], color=styles[pol]["color"], ls="--" if pol != "dense" else ":", label=label)
            elif pts:
                ax.errorbar([p["k"] for p in pts], [p["em"] for p in pts], yerr=[p["se"] for p in pts],
                            capsize=3, label=label, **styles[pol])
        ax.set_xticks(plan["ks"])
        ax.set_xlabel("retrofit families")
        ax.set_ylabel("EM, held-out families (mean)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{comp:.0%} compression" if comp is not None else "")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("held out: " + ", ".join(plan["common_heldout"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_tables(work: Path, out: Path) -> dict:
    """Read WORK, write ``per_seed.csv``, ``held_out.csv``, ``curve.csv``, ``curve.png``, ``verdict.json`` and
    ``table.md`` into ``out``; returns ``{"rows", "curve", "verdict"}``."""
    work, out = Path(work), Path(out)
    plan = load_plan(work)
    baselines, learned = collect(work, plan)
    if not baselines and not learned:
        raise SystemExit(f"{work}: no evaluation folder under baselines/ or k<k>/eval_*_s<seed>/")
    rows = aggregate(baselines, learned, plan)
    points = curve(rows, plan)
    verdicts = verdict(rows, plan)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(learned, out / "per_seed.csv")
    write_csv(rows, out / "held_out.csv")
    write_csv(points, out / "curve.csv")
    plot_curve(points, plan, out / "curve.png")
    (out / "verdict.json").write_text(json.dumps(verdicts, indent=2) + "\n")
    (out / "table.md").write_text(markdown(rows, points, verdicts, plan))
    return {"rows": rows, "curve": points, "verdict": verdicts}


def markdown(rows, points, verdicts, plan) -> str:
    lines = [f"Leave-families-out retrofits (commit {git_commit()}); families {', '.join(plan['families'])}; "
             f"retrofit order {', '.join(plan['order'])}; common held-out {', '.join(plan['common_heldout'])}.", "",
             "| policy | compression | k | family | held out | EM | ± SE | dense | ratio | n | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        comp = "–" if r["compression"] is None else f"{r['compression']:.0%}"
        lines.append(f"| {LABELS.get(r['policy'], r['policy'])} | {comp} | {r['k'] or '–'} | {r['family']} | "
                     f"{'yes' if r['heldout'] is True else ('no' if r['heldout'] is False else '–')} | "
                     f"{r['em']:.3f} | {r['se']:.3f} | {_fmt(r['dense_em']) or '–'} | {_fmt(r['ratio']) or '–'} | "
                     f"{r['n']} | {r['seeds'] or '–'} |")
    lines += ["", "| policy | compression | k | EM (common held-out) | ± SE | ratio to dense |", "|---|---|---|---|---|---|"]
    for p in points:
        comp = "–" if p["compression"] is None else f"{p['compression']:.0%}"
        lines.append(f"| {LABELS.get(p['policy'], p['policy'])} | {comp} | {p['k'] or '–'} | {p['em']:.3f} | "
                     f"{p['se']:.3f} | {_fmt(p['ratio']) or '–'} |")
    lines.append("")
    for v in verdicts:
        what = (f"reached at k = {v['reached_at_k']} on {', '.join(v['families_at_k'])}" if v["reached_at_k"]
                else "not reached at any k")
        lines.append(f"* {LABELS.get(v['policy'], v['policy'])} >= {v['threshold']} of dense on a held-out family "
                     f"at {v['compression']:.0%}: {what}.")
    return "\n".join(lines) + "\n"


def _families_of(folder: Path) -> list[str]:
    """The families of a kvpop-eval folder, in its order (results.csv, else outputs.jsonl)."""
    if (folder / "results.csv").is_file():
        return list(dict.fromkeys(r["family"] for r in csv.DictReader(open(folder / "results.csv"))))
    if (folder / "outputs.jsonl").is_file():
        return list(dict.fromkeys(json.loads(line)["family"] for line in open(folder / "outputs.jsonl")))
    raise SystemExit(f"{folder}: neither results.csv nor outputs.jsonl (not a kvpop-eval folder)")


def _knobs_of(folder: Path) -> dict[str, str]:
    """The knobs a kvpop-eval folder gave each family (its meta.json), as ``key=value`` words; a family left out
    ran with the defaults."""
    meta = folder / "meta.json"
    knobs = json.loads(meta.read_text()).get("knobs", {}) if meta.is_file() else {}
    return {fam: " ".join(f"{k}={v}" for k, v in kw.items()) for fam, kw in knobs.items()}


def teacher_table(eval_dirs, out: Path, min_em: float = THRESHOLD) -> list[dict]:
    """The teacher's dense EM per family from kvpop-eval folders (one or several; for a family in several, the
    first wins): ``teacher_dense_em.csv`` and ``.md`` in ``out`` with EM, SE, n, whether EM >= ``min_em`` and the
    family's knobs (its layout: the problems differ from the defaults')."""
    eval_dirs = [Path(eval_dirs)] if isinstance(eval_dirs, (str, Path)) else [Path(d) for d in eval_dirs]
    out = Path(out)
    rows, seen = [], set()
    for folder in eval_dirs:
        knobs = _knobs_of(folder)
        for fam in _families_of(folder):
            dense = [r for r in rows_of(folder, fam) if r["policy"] == "dense"]
            if dense and fam not in seen:
                seen.add(fam)
                em, n = dense[0]["em"], dense[0]["n"]
                rows.append({"family": fam, "em": em, "se": binomial_se(em, n), "n": n,
                             "knobs": knobs.get(fam, ""), "meets": em >= min_em})  # meets last: scripts grep it
    if not rows:
        raise SystemExit(f"{', '.join(map(str, eval_dirs))}: no dense rows")
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "teacher_dense_em.csv")
    md = ["| family | dense EM | ± SE | n | >= %.2f | knobs |" % min_em, "|---|---|---|---|---|---|"]
    md += [f"| {r['family']} | {r['em']:.3f} | {r['se']:.3f} | {r['n']} | {'yes' if r['meets'] else 'no'} "
           f"| {r['knobs'] or 'default'} |" for r in rows]
    md.append(f"\nevery family >= {min_em}: {'yes' if all(r['meets'] for r in rows) else 'no'}")
    (out / "teacher_dense_em.md").write_text("\n".join(md) + "\n")
    return rows


# -- command line --------------------------------------------------------------------------------------------------
def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # everything after KIND goes to the training command unchanged
        if len(argv) < 2:
            raise SystemExit("usage: leave_families_out train {kvpop,dms} ARGS...")
        train(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="leave_families_out", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="check the split and write WORK/plan.json (or check it against the one there)")
    p.add_argument("work", type=Path)
    p.add_argument("--families", type=_names, default=list(FAMILIES))
    p.add_argument("--order", type=_names, default=list(ORDER), help="retrofit families, added in this order")
    p.add_argument("--ks", type=lambda s: [int(x) for x in _names(s)], default=list(KS))
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting stored in plan.json (length=4096 is required by `table`)")
    s = sub.add_parser("split", help="print one split's families, comma separated")
    s.add_argument("work", type=Path)
    s.add_argument("--k", type=int, required=True)
    s.add_argument("--field", choices=["retrofit", "heldout", "all"], default="retrofit")
    t = sub.add_parser("table", help="held-out tables, curve and verdict")
    t.add_argument("work", type=Path)
    t.add_argument("--out", type=Path, required=True)
    e = sub.add_parser("teacher", help="the teacher's dense EM per family")
    e.add_argument("eval_dirs", type=Path, nargs="+", help="kvpop-eval folders with dense rows")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--min-em", type=float, default=THRESHOLD)
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        settings = {}
        for item in args.setting:
            key, eq, val = item.partition("=")
            if not eq or not key:
                raise SystemExit(f"--setting expects KEY=VALUE, got {item!r}")
            settings[key] = int(val) if re.fullmatch(r"-?\d+", val) else val
        if "length" not in settings:
            raise SystemExit("plan needs --setting length=<tokens per problem> (the evaluations' --length)")
        if "data_knobs" in settings:  # family knobs of every evaluation and retrofit: checked before any work
            from kvpop_lab.testbed.evaluate import check_knobs
            try:
                check_knobs(str(settings["data_knobs"]).split(), int(settings["length"]))
            except ValueError as err:
                raise SystemExit(f"--setting data_knobs (the scripts' DATA_KNOBS: {err})") from None
        try:
            plan = make_plan(args.families, args.order, args.ks, **settings)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        path = args.work / "plan.json"
        if path.is_file():  # the plan of a WORK is fixed at its first call: its folders were made under it
            old = json.loads(path.read_text())
            changed = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            if changed:
                raise SystemExit(f"{path} holds another plan ({', '.join(f'{k}: {old.get(k)} -> {plan.get(k)}' for k in changed)}); "
                                 "use the knobs of its first call or another WORK")
        args.work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan, indent=2) + "\n")
        for k in plan["ks"]:
            sp = plan["splits"][str(k)]
            print(f"k={k}: retrofit {','.join(sp['retrofit'])}; held out {','.join(sp['heldout'])}")
    elif args.cmd == "split":
        plan = load_plan(args.work)
        if str(args.k) not in plan["splits"]:
            raise SystemExit(f"k={args.k} is not in the plan's ks {plan['ks']}")
        sp = plan["splits"][str(args.k)]
        print(",".join(plan["families"] if args.field == "all" else sp[args.field]))
    elif args.cmd == "table":
        res = build_tables(args.work, args.out)
        print((args.out / "table.md").read_text())
        if not res["curve"]:
            print("note: no curve point yet (every common held-out family of a (policy, compression, k) is needed)",
                  file=sys.stderr)
    else:
        rows = teacher_table(args.eval_dirs, args.out, min_em=args.min_em)
        print((args.out / "teacher_dense_em.md").read_text())
        if not all(r["meets"] for r in rows):
            print(f"note: below {args.min_em}: " + ", ".join(r["family"] for r in rows if not r["meets"]),
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
