"""TensorFlow's mixed-precision names, over the mixprec core.

* :mod:`~mixprec.compat.tf._loss_scale` - ``DynamicLossScale``/``FixedLossScale``: the
  core loss scales with TF's argument names, ``__call__``, ``update(grads)``, configs
  and reprs.
* :mod:`~mixprec.compat.tf._optimizer` - ``LossScaleOptimizer``: the core optimizer with
  TF 2's constructor, ``minimize``/``get_scaled_loss``/``get_unscaled_gradients``/
  ``apply_gradients`` and ``get_config``/``from_config``.
* :mod:`~mixprec.compat.tf._graph_rewrite` - ``enable_mixed_precision_graph_rewrite``:
  wraps an optimizer and, given a model, rewrites it with :func:`mixprec.rewrite.rewrite`.

>>> import torch
>>> from mixprec.compat.tf import DynamicLossScale, LossScaleOptimizer
>>> ls = DynamicLossScale(initial_loss_scale=8.0, increment_period=2, multiplier=4.0)
>>> float(ls())
8.0
>>> bool(ls.update([torch.tensor(float("inf"))])), float(ls())   # skip, divide by 4
(False, 2.0)
>>> var = torch.tensor(1.0, requires_grad=True)
>>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
>>> _ = opt.minimize(lambda: var**2, var_list=[var]); float(var.detach())
0.5
"""

from mixprec.compat.tf._graph_rewrite import enable_mixed_precision_graph_rewrite
from mixprec.compat.tf._loss_scale import DynamicLossScale, FixedLossScale
from mixprec.compat.tf._optimizer import LossScaleOptimizer, TFOptimizerAPI

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "TFOptimizerAPI",
    "enable_mixed_precision_graph_rewrite",
]
