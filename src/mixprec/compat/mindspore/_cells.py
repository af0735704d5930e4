"""MindSpore's cells and optimizer, over the core training step.

* ``Momentum(params, learning_rate, momentum, ..., loss_scale=1.0)`` - SGD that divides
  the gradients by an optimizer-side loss scale.
* ``SoftmaxCrossEntropyWithLogits``, ``WithLossCell`` - the loss and the loss network.
* ``TrainOneStepCell(network, optimizer, sens=1.0)`` - one step whose backward starts
  from ``sens``; ``CustomTrainOneStepCell`` divides the factor back out.
* ``build_train_network(network, optimizer, loss_fn=None, level, loss_scale_manager)``.

>>> import torch
>>> net = torch.nn.Linear(2, 1)
>>> step = CustomTrainOneStepCell(net, torch.optim.SGD(net.parameters(), lr=0.1), 1024.0,
...                               loss_fn=torch.nn.functional.mse_loss)
>>> loss = step(torch.ones(4, 2), torch.zeros(4, 1))
>>> loss.dtype, loss.requires_grad
(torch.float32, False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._checks import check_instance, check_number
from mixprec.amp import initialize
from mixprec.compat.mindspore._managers import resolve_loss_scale
from mixprec.loss_scale import NoOpLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.train._step import TrainStep


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
        check_number("loss_scale", loss_scale, minimum=1)
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

    ``network`` returns the loss (e.g. :class:`WithLossCell`), or pass ``loss_fn=`` to
    apply one to its output. The backward pass starts from ``sens`` instead of 1, so
    gradients come out multiplied by ``sens``; as in MindSpore, this base cell does not
    divide them back. :class:`CustomTrainOneStepCell` (the seed's) does, through
    :meth:`scale_grad`.

    Algorithm::

        optimizer.zero_grad(); loss = network(*inputs)
        backward of d(loss) * sens; scale_grad(grads); optimizer.step()
    """

    def __init__(
        self,
        network: nn.Module,
        optimizer: torch.optim.Optimizer,
        sens: float = 1.0,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__(network, optimizer, loss_fn)
        check_number("sens", sens, minimum=0, exclusive=True)
        if isinstance(optimizer, LossScaleOptimizer) and not isinstance(
            optimizer.loss_scaler, NoOpLossScale
        ):
            raise ValueError(
                f"sens={sens!r} scales the loss itself, but the optimizer already scales it "
                f"({optimizer.loss_scaler!r}); use one of the two"
            )
        self.network, self.sens = network, float(sens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward(torch.full_like(loss, self.sens))
        grads = [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        if grads:
            self.scale_grad(grads)

    def scale_grad(self, grads: list[torch.Tensor]) -> None:
        """MindSpore's base cell keeps the ``sens`` factor in the gradients."""


class CustomTrainOneStepCell(TrainOneStepCell):
    """The seed's ``CustomTrainOneStepCell``: gradients of ``d(loss) * sens`` multiplied by
    ``1/sens`` before a plain optimizer step (no overflow check), as MindSpore's
    ``FixedLossScaleManager(sens, drop_overflow_update=False)`` with an optimizer that
    does not unscale."""

    def scale_grad(self, grads: list[torch.Tensor]) -> None:
        """Undo ``sens``: ``grads *= 1/sens`` (one fused kernel)."""
        torch._foreach_mul_(grads, 1.0 / self.sens)


def build_train_network(
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    level: str = "O0",
    loss_scale_manager: Any = None,
    keep_batchnorm_fp32: bool | None = None,
    *,
    dtype: torch.dtype = torch.float16,
) -> TrainStep:
    """Prepare ``network`` for ``level`` and return its training step (MindSpore's name).

    ``loss_fn=None`` (MindSpore's default): the network returns the loss itself, and the
    step passes every argument to it, as MindSpore's own tests call
    ``build_train_network(net, optimizer, level="O2")`` on a network whose
    ``construct(input_x, label)`` computes its loss. With ``loss_fn``, the step applies
    it to the network's output and the last argument (the label).

    ``loss_scale_manager``: ``None`` (the level's default: dynamic for float16
    O1/O2), ``"dynamic"``, a number (a static scale; overflowing steps are
    skipped), a :class:`mixprec.LossScale`, or a manager
    (``FixedLossScaleManager(S, False)`` applies overflowing steps instead of skipping
    them, as in MindSpore).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> step = build_train_network(
    ...     net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
    ...     "O2", loss_scale_manager=128.0, dtype=torch.bfloat16)
    >>> loss = step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> loss.dtype, float(step.optimizer.loss_scale), net[0].weight.dtype
    (torch.float32, 128.0, torch.bfloat16)
    """
    check_instance("network", network, nn.Module, "a torch.nn.Module")
    check_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    loss_scale, drop_overflow_update = (
        (None, True) if loss_scale_manager is None else resolve_loss_scale(loss_scale_manager)
    )
    model, wrapped = initialize(
        network,
        optimizer,
        level,
        dtype=dtype,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        loss_scale=loss_scale,
    )
    if not drop_overflow_update:
        wrapped.skip_nonfinite = False
    return TrainStep(model, wrapped, loss_fn)
