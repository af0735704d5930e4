"""Precision diagnostics: which layers underflow or overflow a dtype, and the loss scale to use.

* :func:`diagnose` (also ``mixprec.diagnose``) - run a few batches through a model and
  get a :class:`PrecisionReport`: per layer (parameters, module activations and their
  gradients) the fraction of values that underflow or overflow the target dtype and
  the exponent range in use; the range of loss scales that keeps gradients
  representable, the recommended one and its margin; the layers at risk under any
  single scale. It prints as a table, saves as JSON and plots to PNG.
* :meth:`PrecisionReport.suggest` - a :class:`Suggestion`: the loss scale to start at
  and the modules to keep in float32, as arguments for ``amp.initialize`` /
  ``LossScaleOptimizer``.
* :class:`GradientMonitor` - during training, through the optimizer's step hooks:
  gradient statistics every N steps with no host sync in between, and the names of
  the gradients that overflowed (``mixprec.train.callbacks.PrecisionMonitor`` puts
  them in the metrics).
* :mod:`.histogram` - the exponent histograms all of these are built on.

>>> import torch, mixprec
>>> net = torch.nn.Linear(4, 2)
>>> report = mixprec.diagnose(net, torch.nn.functional.mse_loss,
...                           [(torch.randn(8, 4), torch.randn(8, 2))])
>>> sorted(report.layers), report.at_risk
(['bias', 'weight'], ())
"""

from mixprec.diagnostics._collect import diagnose
from mixprec.diagnostics._histogram import (
    DtypeRange,
    ExponentCounts,
    ExponentHistogram,
    dtype_range,
)
from mixprec.diagnostics._layers import LayerStats
from mixprec.diagnostics._monitor import DEFAULT_EVERY, GradientMonitor, GradientSample
from mixprec.diagnostics._report import PrecisionReport
from mixprec.diagnostics._suggest import Suggestion

__all__ = [
    "diagnose",
    "PrecisionReport",
    "LayerStats",
    "Suggestion",
    "GradientMonitor",
    "GradientSample",
    "DEFAULT_EVERY",
    "ExponentHistogram",
    "ExponentCounts",
    "DtypeRange",
    "dtype_range",
]
