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
"""

from mixprec.compat import keras, mindspore, tf

__all__ = ["keras", "mindspore", "tf"]
