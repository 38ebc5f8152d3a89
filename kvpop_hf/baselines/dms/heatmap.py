"""Per-head eviction map of DMS beside KVpop's fixed budget (KVpop, arXiv:2607.05061, Figure 8 analogue).

Reads the ``compression.json`` that ``kvpop-eval`` writes for the ``dms`` policy and draws, per budget, the
fraction of the tokens seen that each (layer, KV head) no longer holds at the end of the problems,
``1 - kept / seen`` (0: dense, near 1: window only), for DMS (ragged: the gate decides per head) and for a
KVpopCache of the same budget ``B`` (the same ``1 - B / seen`` for every head).

    python -m kvpop_hf.baselines.dms.heatmap results/dms_cpu/compression.json results/dms_cpu/eviction_ratio_heatmap.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def load_maps(path) -> list[tuple[int, list[list[float]], float]]:
    """``[(B, evicted fraction [layers][kv_heads], seen)]`` for every ``dms@B<B>`` entry, by decreasing ``B``."""
    data = json.loads(Path(path).read_text())
    out = []
    for label, entry in data.items():
        m = re.fullmatch(r"dms@B(\d+)", label)
        if m is None:
            continue
        seen = float(entry["seen"])
        out.append((int(m.group(1)), [[1.0 - k / seen for k in row] for row in entry["kept_per_head"]], seen))
    if not out:
        raise ValueError(f"{path} holds no dms@B<budget> entry: run kvpop-eval with --policies dms first.")
    return sorted(out, key=lambda x: -x[0])


def plot(path, out_png) -> None:
    from ...plotting import pyplot

    plt = pyplot(out_png)
    if plt is None:
        return

    maps = load_maps(path)
    fig, axes = plt.subplots(len(maps), 2, figsize=(8, 3.2 * len(maps)), squeeze=False, layout="constrained")
    for row, (B, frac, seen) in enumerate(maps):
        layers, heads = len(frac), len(frac[0])
        fixed = [[max(0.0, 1.0 - B / seen)] * heads for _ in range(layers)]
        mean_dms = sum(map(sum, frac)) / (layers * heads)
        for col, (grid, name) in enumerate(((frac, f"DMS trained for B={B}: {(1 - mean_dms) * seen:.0f} kept ({mean_dms:.2f})"),
                                            (fixed, f"KVpop: B={B} per head ({fixed[0][0]:.2f})"))):
            ax = axes[row][col]
            im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            for li in range(layers):
                for hi in range(heads):
                    ax.text(hi, li, f"{grid[li][hi]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if grid[li][hi] < 0.6 else "black")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("KV head")
            ax.set_ylabel("layer")
            ax.set_xticks(range(heads))
            ax.set_yticks(range(layers))
    fig.colorbar(im, ax=axes.ravel().tolist(), label="evicted fraction 1 - kept / seen")
    fig.suptitle(f"Evicted fraction per (layer, KV head) after {maps[0][2]:.0f} tokens", fontsize=10)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compression_json")
    ap.add_argument("out_png")
    args = ap.parse_args(argv)
    plot(args.compression_json, args.out_png)
    print(f"wrote {args.out_png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
