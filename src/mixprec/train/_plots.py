"""Training plots: loss, accuracy, and the loss scale with skipped steps marked.

Each PNG also carries the numbers it plots as JSON in a PNG text chunk
(``mixprec-data``), so a plot can be checked, or re-plotted, from the file alone:

>>> import json, tempfile, os
>>> from PIL import Image
>>> path = os.path.join(tempfile.mkdtemp(), "scale.png")
>>> plot_loss_scale([4.0, 2.0, 2.0], skipped=[False, True, False], path=path)
>>> json.loads(Image.open(path).text["mixprec-data"])["skipped_steps"]
[2]
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_loss", "plot_accuracy", "plot_loss_scale", "plot_comparison", "read_plot_data"]

DATA_KEY = "mixprec-data"


@functools.cache
def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend, imported at the first plot (not with the module)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, data: Mapping) -> None:
    from mixprec.train._atomic import atomic_write

    fig.tight_layout()
    try:  # whole or not at all, and never through a link in the file's place
        atomic_write(
            path,
            lambda f: fig.savefig(f, format="png", dpi=100, metadata={DATA_KEY: json.dumps(data)}),
            fsync=False,
        )
    finally:
        _pyplot().close(fig)


def read_plot_data(path: str | Path) -> dict:
    """The JSON data embedded in a PNG written by this module."""
    from PIL import Image

    with Image.open(path) as img:
        return json.loads(img.text[DATA_KEY])


def plot_loss(
    losses: Sequence[float], path: str | Path, epoch_losses: Sequence[float] = ()
) -> None:
    """Per-step training loss (and per-epoch means, if given) against the step."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, lw=0.8, alpha=0.6, label="step loss")
    if epoch_losses:
        per_epoch = len(losses) / len(epoch_losses)
        ax.plot(
            [round(per_epoch * (i + 1)) for i in range(len(epoch_losses))],
            epoch_losses,
            "o-",
            label="epoch mean",
        )
    ax.set(xlabel="step", ylabel="loss", title="Training loss")
    if losses and min(losses) > 0:
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path, {"losses": list(losses), "epoch_losses": list(epoch_losses)})


def plot_accuracy(accuracies: Mapping[str, Sequence[float]], path: str | Path) -> None:
    """Accuracy per epoch, one line per series (e.g. ``train``, ``test``)."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for name, values in accuracies.items():
        ax.plot(range(1, len(values) + 1), values, "o-", label=name)
    ax.set(xlabel="epoch", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path, {name: list(v) for name, v in accuracies.items()})


def plot_loss_scale(
    scales: Sequence[float],
    skipped: Sequence[bool],
    path: str | Path,
    underflow: tuple[Sequence[int], Sequence[float]] | None = None,
) -> None:
    """The loss scale after each step (log scale), skipped steps marked with red crosses.

    ``underflow``: ``(steps, fractions)`` of sampled gradient underflow (for example
    ``PrecisionMonitor.underflow_series()``), drawn against a second axis on the right.
    """
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    steps = list(range(1, len(scales) + 1))
    ax.step(steps, scales, where="post", label="loss scale")
    marked = [s for s, skip in zip(steps, skipped) if skip]
    if marked:
        ax.plot(marked, [scales[s - 1] for s in marked], "rx", ms=8, label="skipped step")
    ax.set(xlabel="step", ylabel="loss scale", title="Loss scale (skipped steps marked)")
    if scales and min(scales) > 0:
        ax.set_yscale("log", base=2)
    handles, labels = ax.get_legend_handles_labels()
    data = {"scales": list(scales), "skipped_steps": marked}
    if underflow is not None:
        at, fractions = list(underflow[0]), [float(f) for f in underflow[1]]
        right = ax.twinx()
        right.plot(at, fractions, "o-", color="tab:orange", ms=3, lw=1, label="gradient underflow")
        right.set_ylabel("fraction of gradient values underflowing")
        right.set_ylim(bottom=0)
        extra_handles, extra_labels = right.get_legend_handles_labels()
        handles, labels = handles + extra_handles, labels + extra_labels
        data.update(underflow_steps=at, underflow_fractions=fractions)
    ax.legend(handles, labels)
    ax.grid(alpha=0.3)
    _save(fig, path, data)


def plot_comparison(rows: Sequence[Mapping], path: str | Path) -> None:
    """Bar charts of test accuracy and step time per configuration (``mixprec compare``)."""
    names = [str(r["config"]) for r in rows]
    fig, axes = _pyplot().subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [r["accuracy"] for r in rows], color="tab:green")
    axes[0].set(ylabel="test accuracy", ylim=(0, 1.02), title="Accuracy")
    axes[1].bar(names, [r["step_ms"] for r in rows], color="tab:blue")
    axes[1].set(ylabel="ms / step", title="Step time")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path, {"rows": [dict(r) for r in rows]})
