"""The main job: train a model with any precision level, with callbacks, metrics and plots.

* :class:`Model` (:mod:`mixprec.train.loop`) - ``Model(net, loss_fn, opt, amp_level=...).train(...)``.
* :class:`TrainStep` (:mod:`mixprec.train.step`) - one optimizer step on one batch, as a callable.
* :mod:`mixprec.train.callbacks`, :mod:`mixprec.train.data`, :mod:`mixprec.train.metrics`,
  :mod:`mixprec.train.models`, :mod:`mixprec.train.plots` - the pieces around the loop.
"""

from mixprec.train.loop import Model
from mixprec.train.step import TrainStep

__all__ = ["Model", "TrainStep"]
