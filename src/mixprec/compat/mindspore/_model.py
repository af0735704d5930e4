"""MindSpore's ``Model(network, loss_fn, optimizer, metrics, amp_level,
loss_scale_manager).train(epoch, dataset)``, over the core :class:`mixprec.train.Model`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mixprec.compat.mindspore._cells import TrainOneStepCell
from mixprec.compat.mindspore._managers import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    resolve_loss_scale,
)
from mixprec.loss_scale import NoOpLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.train._loop import Model as _CoreModel


class Model(_CoreModel):
    """``mindspore.Model(network, loss_fn=None, optimizer=None, metrics=None,
    amp_level="O0", loss_scale_manager=None)`` with ``train(epoch, train_dataset,
    callbacks=None)``.

    * ``amp_level="O2"`` without a manager uses MindSpore's level default,
      ``DynamicLossScaleManager()`` (initial scale 2**24), in float16 and bfloat16 alike.
    * ``network`` may also be a :class:`TrainOneStepCell`, which then does each whole
      step itself (the seed's ``Model(net_with_train)``; no ``amp_level`` or manager).
    * ``FixedLossScaleManager(S, drop_overflow_update=False)`` with an optimizer that has
      its own ``loss_scale`` (:class:`Momentum`): the loss is scaled by ``S`` and the
      gradients are left for the optimizer to divide, as MindSpore does; the two scales
      must agree. With a plain PyTorch optimizer the step divides them instead.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        loss_fn: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Any = None,
        amp_level: str = "O0",
        loss_scale_manager: Any = None,
        **kwargs: Any,
    ) -> None:
        self._cell: TrainOneStepCell | None = None
        self._sens: float | None = None
        if isinstance(network, TrainOneStepCell):
            if optimizer is not None or loss_scale_manager is not None or amp_level != "O0":
                raise ValueError(
                    "a TrainOneStepCell already holds its optimizer and loss scaling: "
                    "pass it alone, Model(net_with_train)"
                )
            self._cell = network
            inner = network.optimizer
            wrapped = (
                inner
                if isinstance(inner, LossScaleOptimizer)
                else LossScaleOptimizer(inner, loss_scale=NoOpLossScale(), skip_nonfinite=False)
            )
            network.optimizer = wrapped  # the cell steps through it: counters stay right
            super().__init__(network.network, loss_fn, wrapped, metrics={}, **kwargs)
            return
        if loss_scale_manager is None and amp_level == "O2" and optimizer is not None:
            # MindSpore's O2 comes with DynamicLossScaleManager() (2**24, x2, 2000).
            loss_scale_manager = DynamicLossScaleManager()
        side_scale = getattr(optimizer, "loss_scale", None)
        if (
            isinstance(loss_scale_manager, FixedLossScaleManager)
            and not loss_scale_manager.get_drop_overflow_update()
            and isinstance(side_scale, float)
        ):
            if side_scale != loss_scale_manager.get_loss_scale():
                raise ValueError(
                    f"the optimizer's loss_scale ({side_scale}) must equal the "
                    f"FixedLossScaleManager's ({loss_scale_manager.get_loss_scale()})"
                )
            self._sens = side_scale
            loss_scale_manager = FixedLossScaleManager(1.0, False)
        loss_scale, drop_overflow_update = (
            (None, True) if loss_scale_manager is None else resolve_loss_scale(loss_scale_manager)
        )
        super().__init__(
            network,
            loss_fn,
            optimizer,
            metrics,
            amp_level,
            loss_scale=loss_scale,
            skip_nonfinite=drop_overflow_update,
            **kwargs,
        )

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self._cell is not None:
            return self._cell(x, y), None
        return super().train_step(x, y)

    def current_loss_scale(self) -> float:
        return super().current_loss_scale() if self._sens is None else self._sens

    def backward(self, loss: torch.Tensor) -> None:
        if self._sens is None:
            super().backward(loss)
        else:
            (loss * self._sens).backward()  # the optimizer divides by its own loss_scale

    def train(  # type: ignore[override]
        self,
        epoch: int,
        train_dataset: Iterable,
        callbacks: Any = None,
        dataset_sink_mode: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Train for ``epoch`` epochs. ``dataset_sink_mode`` (device-side data sinking on
        Ascend) has no PyTorch counterpart and is accepted only for source compatibility."""
        return super().train(epoch, train_dataset, callbacks=callbacks, **kwargs)
