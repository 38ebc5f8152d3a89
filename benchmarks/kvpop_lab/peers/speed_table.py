"""The peers speed table: the rows of ``kvpop_lab.peers.speed_ours`` (KVpop, StaticCache) and
``kvpop_lab.peers.speed_kvpress`` in one CSV, each with its ratios to KVpop's row of the same context and batch.

    python -m kvpop_lab.peers.speed_table --kvpop K.jsonl --kvpress P.jsonl --static S.jsonl \\
        --rows 32768x1 131072x1 32768x8 32768x32 --out speed.csv [--markdown speed.md]

``x_<field>`` = the row's value / KVpop's (above 1: slower or larger than KVpop). A (system, row) its runner did not
reach before its time limit reads ``not run``; ``OOM`` / ``error`` as the runner wrote them. Pure Python.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from kvpop_lab.peers.speed_rows import FAILED, parse_rows, read_rows

SYSTEMS = ("kvpop", "kvpress", "static")
MEASURED = ["prefill_s", "decode_ms", "tokens_per_s", "peak_gb", "decode_peak_gb"]
RATIOS = ["prefill_s", "decode_ms", "peak_gb", "decode_peak_gb"]
COLUMNS = (["system", "path", "context", "batch", "B", "filled"] + MEASURED + [f"x_{f}" for f in RATIOS]
           + ["first_step_s", "entries_end", "device", "commit", "date", "command"])
NOT_RUN = "not run"


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def table(runs: dict[str, list[dict]], rows: list[tuple[int, int]]) -> list[dict]:
    """One line per (row, system) in the order of ``rows`` then :data:`SYSTEMS`; the last line a runner wrote for
    a (context, batch) counts."""
    found = {s: {(r["context"], r["batch"]): r for r in runs.get(s, [])} for s in SYSTEMS}
    out = []
    for key in rows:
        base = found["kvpop"].get(key, {})
        for system in SYSTEMS:
            r = found[system].get(key)
            line = {"system": system, "context": key[0], "batch": key[1]}
            if r is None:
                line.update({f: NOT_RUN for f in MEASURED})
                out.append(line)
                continue
            line.update({c: r.get(c, "") for c in COLUMNS if c not in line})
            failed = r.get("decode_ms") if r.get("decode_ms") in FAILED else None
            for f in MEASURED:  # a failed call failed every field; a row filled in place has no prefill
                line[f] = r[f] if r.get(f) is not None and not failed else (failed or "")
            for f in RATIOS:
                a, b = _number(r.get(f)), _number(base.get(f))
                line[f"x_{f}"] = round(a / b, 2) if a is not None and b else ""
            out.append(line)
    return out


def markdown(lines: list[dict]) -> str:
    cols = ["system", "context", "batch", "B", "filled"] + MEASURED + [f"x_{f}" for f in RATIOS] + ["device"]
    text = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    text += ["| " + " | ".join(str(line.get(c, "")) for c in cols) + " |" for line in lines]
    paths = {line["system"]: line.get("path", "") for line in lines if line.get("path")}
    notes = [f"- {s}: {p}" for s, p in paths.items()]
    commands = sorted({line["command"] for line in lines if line.get("command")})
    return "\n".join(text + [""] + notes + [""] + [f"- `{c}`" for c in commands]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for s in SYSTEMS:
        ap.add_argument(f"--{s}", type=Path, required=True, help=f"JSONL of the {s} runner (missing: none run)")
    ap.add_argument("--rows", nargs="+", required=True, metavar="CONTEXTxBATCH", help="the rows the runners were given")
    ap.add_argument("--out", type=Path, required=True, help="CSV to write")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown here")
    args = ap.parse_args(argv)
    try:
        rows = parse_rows(args.rows)
    except ValueError as err:
        ap.error(str(err))
    lines = table({s: read_rows(getattr(args, s)) for s in SYSTEMS}, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({c: line.get(c, "") for c in COLUMNS} for line in lines)
    if args.markdown:
        args.markdown.write_text(markdown(lines))
    for line in lines:
        print(f"{line['system']:8s} ctx {line['context']:>6} batch {line['batch']:>3}: decode {line['decode_ms']} ms "
              f"(x{line.get('x_decode_ms', '')}), prefill {line['prefill_s']} s, peak {line['peak_gb']} GB")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
