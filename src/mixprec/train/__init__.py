"""The main job: train a model with any precision level, with callbacks, metrics and plots.

* :class:`Model` (:mod:`mixprec.train._loop`) - ``Model(net, loss_fn, opt, amp_level=...).train(...)``.
* :class:`TrainStep` (:mod:`mixprec.train._step`) - one optimizer step on one batch, as a callable.
* :mod:`mixprec.train.callbacks`, :mod:`mixprec.train.data`, :mod:`mixprec.train.metrics`,
  :mod:`mixprec.train.models`, :mod:`mixprec.train._plots` - the pieces around the loop.

Each name and submodule loads on first use, so that the command line reads
:mod:`mixprec.train._names` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.train._divergence import DivergenceError, DivergenceGuard
    from mixprec.train._loop import Model
    from mixprec.train._step import TrainStep

__all__ = ["Model", "TrainStep", "DivergenceError", "DivergenceGuard"]

_NAMES = {
    "Model": "mixprec.train._loop",
    "TrainStep": "mixprec.train._step",
    "DivergenceError": "mixprec.train._divergence",
    "DivergenceGuard": "mixprec.train._divergence",
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
