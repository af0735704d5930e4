"""Seed-faithful façades: the names and defaults of TensorFlow, Keras and MindSpore.

Each module is a thin adapter over the core (``mixprec.loss_scale``,
``mixprec.optim``, ``mixprec.amp``, ``mixprec.rewrite``, ``mixprec.Model``): no
algorithm lives here. ``docs/seeds.md`` maps every seed name to its ``mixprec``
name and lists the deliberate differences.

* :mod:`mixprec.compat.tf` - ``DynamicLossScale``, ``FixedLossScale``,
  ``LossScaleOptimizer`` (TF2), ``enable_mixed_precision_graph_rewrite``.
* :mod:`mixprec.compat.keras` - Keras 3 ``LossScaleOptimizer`` and policies.
* :mod:`mixprec.compat.mindspore` - ``Model``, loss-scale managers, ``LossMonitor``,
  ``to_float``, ``Momentum(loss_scale=)``, ``WithLossCell``, ``TrainOneStepCell``,
  ``TrainOneStepWithLossScaleCell``, the loss-scale update cells.

Each module loads on first use (``mixprec.compat.tf`` does not import the MindSpore
façade's training loop).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixprec.compat import keras, mindspore, tf

__all__ = ["keras", "mindspore", "tf"]


def __getattr__(name: str) -> ModuleType:  # PEP 562: a submodule, imported on first use
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
