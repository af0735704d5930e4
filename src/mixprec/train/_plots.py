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
    """The numbers a plot of this module drew, read back from its PNG file.

    Every plot embeds them as JSON in a PNG text chunk (``mixprec-data``), so the plots
    of ``mixprec train`` and ``mixprec compare`` can be checked, or re-plotted, from the
    files alone.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
    >>> plot_loss([2.0, 1.5, 1.25, 1.0], path, epoch_losses=[1.75, 1.125])
    >>> read_plot_data(path)
    {'losses': [2.0, 1.5, 1.25, 1.0], 'epoch_losses': [1.75, 1.125]}
    """
    from PIL import Image

    with Image.open(path) as img:
        return json.loads(img.text[DATA_KEY])


def plot_loss(
    losses: Sequence[float], path: str | Path, epoch_losses: Sequence[float] = ()
) -> None:
    """Per-step training loss (and per-epoch means, if given) against the step.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
    >>> plot_loss([0.5, 0.25], path)
    >>> read_plot_data(path)["losses"]
    [0.5, 0.25]
    """
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


def plot_accuracy(
    accuracies: Mapping[str, Sequence[float]], path: str | Path, test: float | None = None
) -> None:
    """Accuracy per epoch, one line per series (e.g. ``train``, ``validation``).

    ``test``: the test accuracy, measured once after the last epoch, drawn as one point
    there (it is not a per-epoch series: the test set is not looked at while training).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "accuracy.png")
    >>> plot_accuracy({"train": [0.5, 0.75], "validation": [0.5, 0.625]}, path, test=0.6)
    >>> sorted(read_plot_data(path).items())
    [('test', 0.6), ('train', [0.5, 0.75]), ('validation', [0.5, 0.625])]
    """
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    last = 0
    for name, values in accuracies.items():
        ax.plot(range(1, len(values) + 1), values, "o-", label=name)
        last = max(last, len(values))
    data: dict = {name: list(v) for name, v in accuracies.items()}
    if test is not None:
        label = f"test (once, at the end): {test:.4f}"
        ax.plot([last], [test], "*", ms=14, color="tab:red", label=label)
        data["test"] = test
    ax.set(xlabel="epoch", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    _save(fig, path, data)


def scale_note(
    scales: Sequence[float], dtype: str | None = None, loss_scale: str | None = None
) -> str:
    """What a run did with its loss scale, in words: ``loss_scale.png``'s title.

    Read from the scales themselves (``1`` throughout: not scaled), with the run's
    ``dtype`` and ``loss_scale`` setting (``"dynamic"``, ``"none"`` or a number, as
    ``mixprec train --loss-scale`` takes it) to say why, where given.

    >>> scale_note([1.0, 1.0], "bfloat16", "none")
    "not scaled: bfloat16 has float32's exponent range"
    >>> scale_note([65536.0, 32768.0, 32768.0], "float16", "dynamic")
    'dynamic: 32768 to 65536'
    >>> scale_note([1024.0, 1024.0], "float16", "1024")
    'static: 1024 throughout'
    """
    used = sorted(set(scales))
    if dtype == "float32":
        return "not scaled: float32 (level O0)"
    if not used:
        return "no steps"
    if used == [1.0] and loss_scale in (None, "none"):
        why = {"bfloat16": ": bfloat16 has float32's exponent range"}.get(str(dtype), "")
        return f"not scaled{why}"
    kind = {"dynamic": "dynamic", None: "loss scale"}.get(loss_scale, "static")
    if len(used) == 1:
        return f"{kind}: {used[0]:g} throughout"
    return f"{kind}: {used[0]:g} to {used[-1]:g}"


def plot_loss_scale(
    scales: Sequence[float],
    skipped: Sequence[bool],
    path: str | Path,
    underflow: tuple[Sequence[int], Sequence[float]] | None = None,
    dtype: str | None = None,
    loss_scale: str | None = None,
) -> None:
    """The loss scale after each step (log scale), skipped steps marked with red crosses.

    ``underflow``: ``(steps, fractions)`` of sampled gradient underflow (for example
    ``PrecisionMonitor.underflow_series()``), drawn against a second axis on the right.

    ``dtype`` and ``loss_scale``: the run's low-precision dtype (``"float32"`` for level
    O0) and its loss-scale setting (``"dynamic"``, ``"none"`` or a number, as ``mixprec
    train --loss-scale`` takes it). With them, the title says what the run did and why
    (:func:`scale_note`): a run that was not scaled (bfloat16 by default) shows the scale
    of 1 it used, not a scale it did not have. The embedded data holds the same words as
    ``note``.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "loss_scale.png")
    >>> plot_loss_scale([8.0, 4.0, 4.0, 8.0], [False, True, False, False], path)
    >>> read_plot_data(path)
    {'scales': [8.0, 4.0, 4.0, 8.0], 'skipped_steps': [2], 'note': 'loss scale: 4 to 8'}
    >>> plot_loss_scale([1.0, 1.0], [False, False], path, dtype="bfloat16", loss_scale="none")
    >>> read_plot_data(path)["note"]
    "not scaled: bfloat16 has float32's exponent range"
    """
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    steps = list(range(1, len(scales) + 1))
    note = scale_note(scales, dtype, loss_scale)
    ax.step(steps, scales, where="post", label="loss scale")
    marked = [s for s, skip in zip(steps, skipped) if skip]
    if marked:
        ax.plot(marked, [scales[s - 1] for s in marked], "rx", ms=8, label="skipped step")
    ax.set(xlabel="step", ylabel="loss scale", title=f"Loss scale: {note}")
    if scales and min(scales) > 0:
        ax.set_yscale("log", base=2)
    if steps:
        ax.set_xlim(0.5, steps[-1] + 0.5)  # the first sample (step 1) off the frame edge
    ax.text(
        0.02, 0.95, f"{len(marked)} skipped step(s) of {len(steps)}",
        transform=ax.transAxes, va="top", fontsize=9,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8},
    )  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    data: dict = {"scales": list(scales), "skipped_steps": marked, "note": note}
    if underflow is not None and len(underflow[0]):
        at, fractions = list(underflow[0]), [float(f) for f in underflow[1]]
        right = ax.twinx()
        right.plot(at, fractions, "o-", color="tab:orange", ms=3, lw=1, label="gradient underflow")
        right.set_ylabel("fraction of gradient values underflowing")
        right.set_ylim(bottom=0, top=max(max(fractions) * 1.2, 1e-3))
        extra_handles, extra_labels = right.get_legend_handles_labels()
        handles, labels = handles + extra_handles, labels + extra_labels
        data.update(underflow_steps=at, underflow_fractions=fractions)
    ax.legend(handles, labels, loc="upper right")
    ax.grid(alpha=0.3)
    _save(fig, path, data)


def plot_comparison(rows: Sequence[Mapping], path: str | Path, title: str | None = None) -> None:
    """Bar charts of test accuracy, step time and peak memory per configuration
    (``mixprec compare``), each bar labelled with its value; ``title`` heads the figure
    (e.g. the model, epochs and device).

    Each row needs ``config`` (the bar's label), ``accuracy``, ``step_ms`` and
    ``peak_mb``, as in ``compare.json``.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "compare.png")
    >>> rows = [{"config": "O0", "accuracy": 0.95, "step_ms": 2.0, "peak_mb": 310.0},
    ...         {"config": "O2 bfloat16", "accuracy": 0.94, "step_ms": 1.5, "peak_mb": 290.0}]
    >>> plot_comparison(rows, path, title="mlp on digits")
    >>> [row["config"] for row in read_plot_data(path)["rows"]]
    ['O0', 'O2 bfloat16']
    """
    names = [str(r["config"]) for r in rows]
    fig, axes = _pyplot().subplots(1, 3, figsize=(14, 4.5))
    panels = (
        ("accuracy", "test accuracy", "Accuracy", "tab:green", "{:.3f}"),
        ("step_ms", "ms / step (median)", "Step time", "tab:blue", "{:.2f}"),
        ("peak_mb", "peak memory (MB)", "Memory", "tab:purple", "{:.0f}"),
    )
    for ax, (key, ylabel, name, color, fmt) in zip(axes, panels):
        values = [float(r[key]) for r in rows]
        bars = ax.bar(names, values, color=color)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=2, fontsize=8)
        ax.set(ylabel=ylabel, title=name)
        top = max((v for v in values if v == v), default=1.0)  # NaN-safe
        ax.set_ylim(0, (1.02 if key == "accuracy" else top) * 1.15 or 1.0)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    _save(fig, path, {"rows": [dict(r) for r in rows], "title": title})
