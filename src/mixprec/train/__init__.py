"""The main job: train a model with any precision level, with callbacks, metrics and plots.

* :class:`Model` (:mod:`mixprec.train._loop`) - ``Model(net, loss_fn, opt, amp_level=...).train(...)``.
* :class:`TrainStep` (:mod:`mixprec.train._step`) - one optimizer step on one batch, as a callable.
* :class:`DivergenceGuard` and :class:`DivergenceError` - a run that diverged stops with
  a clear error.
* Checkpoints are loaded safely (``Model.train(resume=...)``): a file that would run
  code is an :class:`UnsafeCheckpointError`, a damaged one a :class:`CorruptCheckpointError`
  (both :class:`CheckpointError`, a ``ValueError``). :func:`atomic_write` writes a file
  whole or not at all, as checkpoints and plots are written.
* :func:`plot_loss`, :func:`plot_accuracy`, :func:`plot_loss_scale`,
  :func:`plot_comparison` - the plots of ``mixprec train`` and ``mixprec compare``;
  :func:`read_plot_data` reads back the numbers a plot holds.
* :mod:`mixprec.train.callbacks`, :mod:`mixprec.train.data`, :mod:`mixprec.train.metrics`,
  :mod:`mixprec.train.models` - the pieces around the loop.

Each name and submodule loads on first use, so that the command line reads
:mod:`mixprec.train._names` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.train._atomic import atomic_write
    from mixprec.train._checkpoint import (
        CheckpointError,
        CorruptCheckpointError,
        UnsafeCheckpointError,
    )
    from mixprec.train._divergence import DivergenceError, DivergenceGuard
    from mixprec.train._loop import Model
    from mixprec.train._plots import (
        plot_accuracy,
        plot_comparison,
        plot_loss,
        plot_loss_scale,
        read_plot_data,
    )
    from mixprec.train._step import TrainStep

__all__ = [
    "Model",
    "TrainStep",
    "DivergenceError",
    "DivergenceGuard",
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "atomic_write",
    "plot_loss",
    "plot_accuracy",
    "plot_loss_scale",
    "plot_comparison",
    "read_plot_data",
]

_NAMES = {
    "Model": "mixprec.train._loop",
    "TrainStep": "mixprec.train._step",
    "DivergenceError": "mixprec.train._divergence",
    "DivergenceGuard": "mixprec.train._divergence",
    **dict.fromkeys(
        ("CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError"),
        "mixprec.train._checkpoint",
    ),
    "atomic_write": "mixprec.train._atomic",
    **dict.fromkeys(
        ("plot_loss", "plot_accuracy", "plot_loss_scale", "plot_comparison", "read_plot_data"),
        "mixprec.train._plots",
    ),
}
#: The public submodules; the others (``_loop``, ``_checkpoint``...) are internal.
_SUBMODULES = frozenset({"callbacks", "data", "metrics", "models"})


def __getattr__(name: str) -> Any:  # PEP 562: imported on first use
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _SUBMODULES or (name.startswith("_") and not name.startswith("__")):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
