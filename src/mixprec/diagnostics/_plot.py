"""The report as a picture: each layer's exponent range against what the dtype can hold.

One horizontal bar per layer and tensor, on an axis of exponents (``log2 |x|``): the
thin bar spans every nonzero value, the thick bar the middle 98 %. Gradients are
drawn shifted by the recommended loss scale (their unscaled range as a grey bar
behind). The background marks the dtype's normal range (green), its subnormal
range (yellow) and beyond (red); rows at risk are labelled in red.

Matplotlib is imported here, not with the package, and only its Agg canvas is used
(no pyplot, no change to the user's backend). The PNG carries the plotted numbers
as JSON in a text chunk (``mixprec-data``), like the training plots.

>>> import os, tempfile
>>> from PIL import Image
>>> from mixprec.diagnostics._histogram import ExponentCounts
>>> from mixprec.diagnostics._layers import LayerStats
>>> from mixprec.diagnostics._report import PrecisionReport
>>> g = ExponentCounts({-20: 9, -8: 1}, 0, 0, 10)
>>> report = PrecisionReport([LayerStats("w", "parameter", torch.float16, {"grad": g})])
>>> path = os.path.join(tempfile.mkdtemp(), "r.png")
>>> plot_report(report, path)
>>> json.loads(Image.open(path).text["mixprec-data"])["rows"][0]["scaled"]
[-10, 2]
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (the doctest uses it)

from mixprec.diagnostics._histogram import ExponentCounts, dtype_range
from mixprec.diagnostics._layers import GRADIENTS

DATA_KEY = "mixprec-data"


def _quantile_span(counts: ExponentCounts, low: float = 0.01, high: float = 0.99) -> list[int]:
    """The exponents between the ``low`` and ``high`` quantiles of the nonzero values."""
    items = list(counts.exponents.items())
    total = sum(n for _, n in items)
    seen, start, end = 0, items[0][0], items[-1][0]
    for e, n in items:
        if seen < low * total <= seen + n:
            start = e
        if seen < high * total <= seen + n:
            end = e
        seen += n
    return [start, end]


def _rows(report: Any) -> list[dict[str, Any]]:
    shift = int(math.log2(report.recommended_loss_scale))
    rows = []
    for name, layer in report.layers.items():
        for tensor, counts in layer.tensors.items():
            span = counts.exponent_range()
            if span is None:
                continue
            k = shift if tensor in GRADIENTS else 0
            middle = _quantile_span(counts)
            rows.append(
                {
                    "label": f"{name} {tensor}",
                    "unscaled": list(span),
                    "scaled": [span[0] + k, span[1] + k],
                    "middle": [middle[0] + k, middle[1] + k],
                    "at_risk": (name, tensor) in report.risky_tensors,
                    "gradient": tensor in GRADIENTS,
                }
            )
    return rows


def plot_report(report: Any, path: str | Path) -> None:
    """Draw ``report`` (a :class:`~mixprec.diagnostics.PrecisionReport`) to a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rng = dtype_range(report.dtype)
    rows = _rows(report)
    fig = Figure(figsize=(9, 1.6 + 0.24 * max(len(rows), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lows = [r["unscaled"][0] for r in rows] + [r["scaled"][0] for r in rows] + [rng.min_subnormal]
    highs = [r["unscaled"][1] for r in rows] + [r["scaled"][1] for r in rows] + [rng.max]
    left, right = min(lows) - 3, max(highs) + 3
    ax.axvspan(left, rng.min_subnormal - 1, color="tab:red", alpha=0.12, lw=0)
    ax.axvspan(rng.min_subnormal - 1, rng.min_normal, color="gold", alpha=0.25, lw=0)
    ax.axvspan(rng.min_normal, rng.max + 1, color="tab:green", alpha=0.12, lw=0)
    ax.axvspan(rng.max + 1, right, color="tab:red", alpha=0.12, lw=0)
    for y, row in enumerate(rows):
        if row["gradient"] and row["unscaled"] != row["scaled"]:
            lo, hi = row["unscaled"]
            ax.plot([lo, hi + 1], [y, y], color="0.75", lw=2, solid_capstyle="butt")
        colour = "tab:red" if row["at_risk"] else "tab:blue"
        lo, hi = row["scaled"]
        ax.plot([lo, hi + 1], [y, y], color=colour, lw=1.2, solid_capstyle="butt")
        lo, hi = row["middle"]
        ax.plot([lo, hi + 1], [y, y], color=colour, lw=6, solid_capstyle="butt")
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    for tick, row in zip(ax.get_yticklabels(), rows):
        if row["at_risk"]:
            tick.set_color("tab:red")
    ax.invert_yaxis()
    ax.set_xlim(left, right)
    ax.set_xlabel("exponent (log2 |x|); gradients at the recommended loss scale (grey: unscaled)")
    scale = report.recommended_loss_scale
    ax.set_title(
        f"{str(report.dtype).replace('torch.', '')}: normal (green), subnormal (yellow), "
        f"out of range (red); loss scale {scale:g}",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    data = {
        "dtype": str(report.dtype).replace("torch.", ""),
        "recommended_loss_scale": scale,
        "normal": [rng.min_normal, rng.max],
        "min_subnormal": rng.min_subnormal,
        "rows": rows,
    }
    fig.savefig(path, dpi=100, metadata={DATA_KEY: json.dumps(data)})
