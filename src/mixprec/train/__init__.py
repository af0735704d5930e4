"""The main job: train a model with any precision level, with callbacks, metrics and plots.

* :class:`Model` (:mod:`mixprec.train.loop`) - ``Model(net, loss_fn, opt, amp_level=...).train(...)``.
* :class:`TrainStep` (:mod:`mixprec.train.step`) - one optimizer step on one batch, as a callable.
* :mod:`mixprec.train.callbacks`, :mod:`mixprec.train.data`, :mod:`mixprec.train.metrics`,
  :mod:`mixprec.train.models`, :mod:`mixprec.train.plots` - the pieces around the loop.

Each name and submodule loads on first use, so that the command line reads
:mod:`mixprec.train._names` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.train.loop import Model
    from mixprec.train.step import TrainStep

__all__ = ["Model", "TrainStep"]

_NAMES = {"Model": "mixprec.train.loop", "TrainStep": "mixprec.train.step"}
_SUBMODULES = frozenset(
    {"callbacks", "checkpoint", "data", "distributed", "divergence", "loop", "metrics", "models",
     "plots", "step"}
)  # fmt: skip


def __getattr__(name: str) -> Any:  # PEP 562: imported on first use
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
