"""Merge the two kvpop-eval runs of the KVP agents at 75% on the 4k testbed (results/testbed_4k/kvp_cpu/eval_cr75
and eval_cr75_rest, problems 0-15 and 16-39) into eval_cr75_all: outputs concatenated, rows weighted by problems
(EM, lookups) and target tokens (token accuracy). Run from the repository root."""
import csv, pathlib
d = pathlib.Path("results/testbed_4k/kvp_cpu"); out = d / "eval_cr75_all"; out.mkdir(exist_ok=True)
parts = [d / "eval_cr75", d / "eval_cr75_rest"]
(out / "outputs.jsonl").write_text("".join((p / "outputs.jsonl").read_text() for p in parts))
rows = {}
for p in parts:
    for r in csv.DictReader(open(p / "results.csv")):
        a = rows.setdefault(r["policy"], {**r, "n": 0, "n_target_tokens": 0, "em": 0.0, "token_acc": 0.0, "lookup_acc": 0.0})
        n, t = int(r["n"]), int(r["n_target_tokens"])
        a["em"] += float(r["em"]) * n; a["lookup_acc"] += float(r["lookup_acc"]) * n  # 15 lookups in every problem
        a["token_acc"] += float(r["token_acc"]) * t; a["n"] += n; a["n_target_tokens"] += t
for a in rows.values():
    a["em"] /= a["n"]; a["lookup_acc"] /= a["n"]; a["token_acc"] /= a["n_target_tokens"]
with open(out / "results.csv", "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(next(iter(rows.values())).keys())); w.writeheader()
    for a in rows.values():
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in a.items()})
print((out / "results.csv").read_text())
