"""Figures are optional: without matplotlib (``pip install -e ".[plots]"``) a command writes its tables and
results files and prints a note for each figure it skips."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence


def pyplot(path: Path | str):
    """``matplotlib.pyplot`` (on the non-interactive Agg backend), or None after a printed note that ``path`` is
    skipped because matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so the figure {path} is skipped (tables and results files are "
              "written); install it with `pip install -e \".[plots]\"` (or `pip install matplotlib`) for figures.",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_styles(policies: Sequence[str]) -> dict[str, dict]:
    """A distinct colour (tab20) and marker per policy, learned ones drawn solid and the rest dashed."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    markers = "osD^v<>pXh*"
    return {p: dict(color=colours[i % 20], marker=markers[i % len(markers)],
                    ls="-" if p.startswith(("kvpop", "kvp")) else "--") for i, p in enumerate(policies)}
