"""MindSpore's mixed-precision names, over the mixprec core.

The seed's ``Model(network, loss_fn, optimizer, metrics, amp_level,
loss_scale_manager).train(epoch, dataset)`` and its pieces, in PyTorch:

>>> import torch
>>> from mixprec.compat.mindspore import (Model, FixedLossScaleManager, Momentum,
...     SoftmaxCrossEntropyWithLogits)
>>> net = torch.nn.Linear(4, 3)
>>> opt = Momentum(net.parameters(), learning_rate=0.01, momentum=0.9, loss_scale=1024.0)
>>> model = Model(net, SoftmaxCrossEntropyWithLogits(reduction="mean"), opt,
...               amp_level="O0", loss_scale_manager=FixedLossScaleManager(1024.0, False))
>>> data = [(torch.randn(8, 4), torch.eye(3)[torch.randint(0, 3, (8,))]) for _ in range(4)]
>>> history = model.train(2, data)
>>> len(history.losses)
8
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.amp import TrainStep, to_float
from mixprec.callbacks import LossMonitor
from mixprec.loss_scale import NoOpLossScale
from mixprec.managers import DynamicLossScaleManager, FixedLossScaleManager
from mixprec.metrics import Accuracy
from mixprec.optim import LossScaleOptimizer
from mixprec.train import Model as _CoreModel

__all__ = [
    "Model",
    "FixedLossScaleManager",
    "DynamicLossScaleManager",
    "LossMonitor",
    "Accuracy",
    "to_float",
    "Momentum",
    "SoftmaxCrossEntropyWithLogits",
    "WithLossCell",
    "TrainOneStepCell",
]


class Momentum(torch.optim.SGD):
    """``nn.Momentum(params, learning_rate, momentum, weight_decay=0.0, loss_scale=1.0,
    use_nesterov=False)``: SGD with momentum that divides the gradients by ``loss_scale``.

    The optimizer-side ``loss_scale`` pairs with ``FixedLossScaleManager(S,
    drop_overflow_update=False)``: the training step then leaves the gradients scaled
    by ``S`` and this optimizer divides them, so ``loss_scale`` must equal ``S``.
    """

    def __init__(
        self,
        params: Any,
        learning_rate: float,
        momentum: float,
        weight_decay: float = 0.0,
        loss_scale: float = 1.0,
        use_nesterov: bool = False,
    ) -> None:
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):
            raise TypeError(f"loss_scale must be a number >= 1, got {loss_scale!r}")
        if not (math.isfinite(loss_scale) and loss_scale >= 1):
            raise ValueError(f"loss_scale must be a finite number >= 1, got {loss_scale!r}")
        super().__init__(
            params,
            lr=learning_rate,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=use_nesterov,
        )
        self.loss_scale = float(loss_scale)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.loss_scale != 1.0:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        return super().step(closure)


class SoftmaxCrossEntropyWithLogits(torch.nn.Module):
    """``nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="none")``.

    ``sparse=False`` takes one-hot (or probability) labels, ``sparse=True`` class
    indices. Computed in float32 whatever the logits' dtype.
    """

    def __init__(self, sparse: bool = False, reduction: str = "none") -> None:
        super().__init__()
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
        self.sparse, self.reduction = bool(sparse), reduction

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        target = labels.long().reshape(-1) if self.sparse else labels.float()
        return F.cross_entropy(logits.float(), target, reduction=self.reduction)


class WithLossCell(torch.nn.Module):
    """``nn.WithLossCell(backbone, loss_fn)``: ``forward(data, label)`` returns the loss."""

    def __init__(self, backbone: torch.nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.backbone, self.loss_fn = backbone, loss_fn

    def forward(self, data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.backbone(data).float(), label)


class TrainOneStepCell(TrainStep):
    """``nn.TrainOneStepCell(network, optimizer, sens=1.0)``: one step on a loss network.

    ``network`` returns the loss (e.g. :class:`WithLossCell`). The backward pass starts
    from ``sens`` instead of 1, so gradients come out multiplied by ``sens``; as in
    MindSpore, this base cell does not divide them back. Override :meth:`scale_grad`
    to do so, as the seed's ``CustomTrainOneStepCell`` does::

        class CustomTrainOneStepCell(TrainOneStepCell):
            def scale_grad(self, grads):
                torch._foreach_mul_(grads, 1.0 / self.sens)
    """

    def __init__(
        self, network: torch.nn.Module, optimizer: torch.optim.Optimizer, sens: float = 1.0
    ) -> None:
        super().__init__(network, optimizer, loss_fn=None, sens=sens)
        self.network = network

    def scale_grad(self, grads: list[torch.Tensor]) -> None:
        """MindSpore's base cell keeps the ``sens`` factor in the gradients."""


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
        super().__init__(
            network, loss_fn, optimizer, metrics, amp_level, loss_scale_manager, **kwargs
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
