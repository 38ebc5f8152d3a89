"""The peers figure: exact match per policy for each implementation (left, one panel per compression) and, when a
speed table is given, decode ms/token and peak memory per system and row (right).

    python -m kvpop_lab.peers.plot --quality results/peers/quality_4k.csv [--speed results/peers/speed_h200.csv] \\
        --out results/figures/peers_4k.png

Quality: ``em`` ± ``se`` of ``kvpop_lab.peers.score``'s CSV as points, one group per policy, one colour per
(library, mode); the dense row is a dashed line, ``--chance`` a dotted one. Speed bars: ``kvpop_lab.peers.speed_table``'s CSV; a row that did not run (``not
run``, ``OOM``) draws no bar and is named under the axis.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def read_quality(path: Path) -> list[dict]:
    """The score CSV's rows with a numeric EM (the variant rows, e.g. SnapKV with another window, are kept)."""
    rows = [r for r in csv.DictReader(open(path)) if _float(r.get("em")) is not None]
    if not rows:
        raise ValueError(f"{path} holds no row with an exact match: run kvpop_lab.peers.score first")
    return rows


def _impl(row: dict) -> str:
    """The implementation a row belongs to: library and mode, the DecodingPress interval left out (it is the
    press's, docs/peers.md), a variant's setting kept."""
    mode = row["mode"].split(" every ")[0].replace("decoding", "DecodingPress")
    return f"{row['library'].split()[0]}, {mode}"


def plot(quality: list[dict], speed: list[dict] | None, path: Path, chance: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [r for r in quality if r["policy"] == "dense"]
    rest = [r for r in quality if r["policy"] != "dense"]
    comps = list(dict.fromkeys(r["compression"] for r in rest))
    policies = list(dict.fromkeys(r["policy"] for r in rest))
    impls = list(dict.fromkeys(_impl(r) for r in rest))
    n_speed = 2 if speed else 0
    fig, axes = plt.subplots(1, len(comps) + n_speed, figsize=(4.6 * (len(comps) + n_speed), 3.9), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, comp in zip(axes[0], comps):
        for j, impl in enumerate(impls):
            xs, ys, es = [], [], []
            for i, pol in enumerate(policies):
                hit = [r for r in rest if r["compression"] == comp and r["policy"] == pol and _impl(r) == impl]
                if hit:
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    ys.append(float(hit[0]["em"]))
                    es.append(_float(hit[0]["se"]) or 0.0)
            ax.errorbar(xs, ys, yerr=es, fmt="o", markersize=5, capsize=2, color=f"C{j}", label=impl)
        for d in dense:
            ax.axhline(float(d["em"]), color="black", linestyle="--", linewidth=0.9, label="dense (no eviction)")
        if chance is not None:
            ax.axhline(chance, color="gray", linestyle=":", linewidth=0.9, label=f"chance ({chance:g})")
        n = sorted({r["n"] for r in rest if r["compression"] == comp})
        ax.set_title(f"compression {comp}, B = {_b(rest, comp)} (n = {', '.join(n)})", fontsize=9)
        ax.set_xticks(range(len(policies)))
        ax.set_xticklabels(policies, rotation=20, fontsize=8)
        ax.set_ylim(-0.03, 1.05)
        ax.set_xlim(-0.6, len(policies) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("exact match ± SE")
    handles, labels = axes[0][0].get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    if speed:
        _speed_panels(axes[0][len(comps)], axes[0][len(comps) + 1], speed)
    fig.legend(list(keep.values()), list(keep.keys()), loc="lower center", ncol=min(3, len(keep)), fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, 0.05 * (1 + (len(keep) - 1) // 3), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _b(rows: list[dict], comp: str) -> str:
    return next(r["B"] for r in rows if r["compression"] == comp)


def _speed_panels(ax_ms, ax_gb, speed: list[dict]) -> None:
    keys = list(dict.fromkeys((r["context"], r["batch"]) for r in speed))
    systems = list(dict.fromkeys(r["system"] for r in speed))
    width = 0.8 / max(1, len(systems))
    missing = []
    for j, system in enumerate(systems):
        for ax, field in ((ax_ms, "decode_ms"), (ax_gb, "peak_gb")):
            xs, ys = [], []
            for i, key in enumerate(keys):
                r = next((r for r in speed if r["system"] == system and (r["context"], r["batch"]) == key), None)
                v = _float(r.get(field)) if r else None
                if v is None:
                    if field == "decode_ms":
                        missing.append(f"{system} {int(key[0]) // 1024}k x{key[1]}: {r.get(field) if r else 'absent'}")
                    continue
                xs.append(i + (j - (len(systems) - 1) / 2) * width)
                ys.append(v)
            ax.bar(xs, ys, width, color=f"C{j + 5}", label=f"speed: {system}")
    for ax, label in ((ax_ms, "decode ms/token"), (ax_gb, "peak GB above the weights")):
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{int(c) // 1024}k x{b}" for c, b in keys], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    if missing:
        ax_ms.set_xlabel("no bar: " + "; ".join(missing), fontsize=6, wrap=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quality", type=Path, required=True, help="kvpop_lab.peers.score's CSV")
    ap.add_argument("--speed", type=Path, default=None, help="kvpop_lab.peers.speed_table's CSV (optional)")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--chance", type=float, default=None, help="draw the chance level of the task (testbed: 0.1)")
    args = ap.parse_args(argv)
    for p in (args.quality, args.speed):
        if p is not None and not p.is_file():
            ap.error(f"{p} does not exist")
    try:
        quality = read_quality(args.quality)
    except ValueError as err:
        ap.error(str(err))
    speed = list(csv.DictReader(open(args.speed))) if args.speed else None
    plot(quality, speed, args.out, args.chance)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
