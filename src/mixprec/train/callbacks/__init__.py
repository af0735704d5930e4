"""Training callbacks: hooks a trainer calls with a :class:`RunState` snapshot.

A trainer drives callbacks in this order (``state`` is one mutable
:class:`RunState` it keeps up to date)::

    on_train_begin(state)           # state.epoch = epochs already done (0, or k on resume)
    for each epoch:
        state.epoch += 1; state.step_in_epoch = 0
        on_epoch_begin(state)
        for each batch:
            ... forward, scaled backward, optimizer step (maybe skipped) ...
            state.step += 1; state.step_in_epoch += 1; state.loss = ...; state.skipped = ...
            on_step_end(state)
        state.metrics = {"loss": mean train loss, "accuracy": ..., "val_accuracy": ...}
        on_epoch_end(state)         # a callback may set state.stop_training = True
        if state.stop_training: break
    on_train_end(state)

Callbacks that print use ``tqdm.write`` so their lines do not tear a progress bar.

>>> state = RunState(epochs=1, steps_per_epoch=2)
>>> hist = History()
>>> cbs = CallbackList([LossMonitor(), hist])
>>> cbs.on_train_begin(state)
>>> state.epoch = 1
>>> for loss in (0.75, 0.5):
...     state.step += 1; state.step_in_epoch += 1; state.loss = loss
...     cbs.on_step_end(state)
epoch: 1 step: 1, loss is 0.75
epoch: 1 step: 2, loss is 0.5
>>> hist.losses
[0.75, 0.5]
"""

from mixprec.train.callbacks._base import Callback, CallbackList, RunState, format_loss
from mixprec.train.callbacks._control import EarlyStopping, LRScheduler, ModelCheckpoint
from mixprec.train.callbacks._float8 import Float8Monitor
from mixprec.train.callbacks._monitors import LossMonitor, LossScaleMonitor, ProgressBar
from mixprec.train.callbacks._precision import PrecisionMonitor
from mixprec.train.callbacks._records import CSVLogger, History

__all__ = [
    "RunState",
    "Callback",
    "CallbackList",
    "LossMonitor",
    "LossScaleMonitor",
    "ProgressBar",
    "PrecisionMonitor",
    "Float8Monitor",
    "History",
    "CSVLogger",
    "EarlyStopping",
    "ModelCheckpoint",
    "LRScheduler",
    "format_loss",
]
