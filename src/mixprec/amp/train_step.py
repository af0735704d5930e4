"""One training step as a callable: MindSpore's ``TrainOneStepWithLossScaleCell`` in PyTorch.

:func:`build_train_network` prepares a model and optimizer for a level and returns
a :class:`TrainStep`; calling it runs forward, loss (float32), scaled backward,
unscale, finite check, skip-or-apply and the loss-scale update, and returns the loss.

``TrainStep(..., sens=S)`` is the seed's ``CustomTrainOneStepCell``: gradients are
computed for ``d(loss) * S`` and multiplied by ``1/S`` before a plain optimizer
step, with no overflow check (MindSpore's ``FixedLossScaleManager(S,
drop_overflow_update=False)`` with an optimizer that does not unscale).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.amp.levels import initialize
from mixprec.amp.module_policy import check_module
from mixprec.loss_scale import NoOpLossScale

__all__ = ["TrainStep", "build_train_network"]


class TrainStep:
    """``step(*inputs, target) -> loss``: one optimizer step on one batch.

    The last positional argument is the target unless ``target=`` is given by
    keyword; with ``loss_fn=None`` the model returns the loss itself (MindSpore's
    ``WithLossCell`` style) and every argument is a model input.

    Algorithm::

        optimizer.zero_grad()
        loss = loss_fn(model(*inputs), target)           # model output is float32
        sens is None:  optimizer.scale_loss(loss).backward(); optimizer.step()
                       # LossScaleOptimizer: unscale, check, skip or apply, update scale
        sens = S:      backward of d(loss) * S; self.scale_grad(grads); optimizer.step()
        return loss.detach()

    :meth:`scale_grad` multiplies the gradients by ``1/S``; a subclass may override
    it (MindSpore's ``TrainOneStepCell`` keeps the factor, the seed's
    ``CustomTrainOneStepCell`` divides it out). Host syncs: only the optimizer's (one
    per step for a ``LossScaleOptimizer`` over a non-fused optimizer).

    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> step = TrainStep(net, sgd, torch.nn.functional.mse_loss, sens=1024.0)
    >>> loss = step(torch.ones(4, 2), torch.zeros(4, 1))
    >>> loss.dtype, loss.requires_grad
    (torch.float32, False)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        sens: float | None = None,
    ) -> None:
        from mixprec.optim import LossScaleOptimizer

        check_module("model", model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if sens is not None:
            if isinstance(sens, bool) or not isinstance(sens, numbers.Real):
                raise TypeError(f"sens must be a positive number or None, got {sens!r}")
            if not (math.isfinite(sens) and sens > 0):
                raise ValueError(f"sens must be a positive finite number, got {sens!r}")
            if isinstance(optimizer, LossScaleOptimizer) and not isinstance(
                optimizer.loss_scaler, NoOpLossScale
            ):
                raise ValueError(
                    f"sens={sens!r} scales the loss itself, but the optimizer already scales it "
                    f"({optimizer.loss_scaler!r}); use one of the two"
                )
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.sens = None if sens is None else float(sens)

    def scale_grad(self, grads: list[torch.Tensor]) -> None:
        """Undo ``sens`` on the gradients in place: ``grads *= 1/sens`` (one fused kernel).

        A subclass may override it, as the seed's ``CustomTrainOneStepCell`` does.
        """
        torch._foreach_mul_(grads, 1.0 / self.sens)

    def __call__(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        from mixprec.optim import LossScaleOptimizer

        has_target = "target" in kwargs
        target = kwargs.pop("target", None)
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}; only target= is taken")
        if self.loss_fn is not None and not has_target:
            if len(inputs) < 2:
                raise TypeError(
                    f"step needs the model inputs and a target, got {len(inputs)} argument(s); "
                    "call step(x, y) or step(x, target=y)"
                )
            inputs, target = inputs[:-1], inputs[-1]
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(*inputs)
        loss = output if self.loss_fn is None else self.loss_fn(output, target)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ValueError(
                f"the loss must be a one-element tensor, got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        if self.sens is not None:
            loss.backward(torch.full_like(loss, self.sens))
            grads = [
                p.grad
                for g in self.optimizer.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
            if grads:
                self.scale_grad(grads)
        elif isinstance(self.optimizer, LossScaleOptimizer):
            # Checked per call: a wrapper may swap the optimizer after construction.
            self.optimizer.scale_loss(loss).backward()
        else:
            loss.backward()
        self.optimizer.step()
        return loss.detach()


def build_train_network(
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None,
    level: str = "O0",
    loss_scale_manager: Any = None,
    keep_batchnorm_fp32: bool | None = None,
    *,
    dtype: torch.dtype = torch.float16,
) -> TrainStep:
    """Prepare ``network`` for ``level`` and return its :class:`TrainStep` (MindSpore's name).

    ``loss_scale_manager``: ``None`` (the level's default: dynamic for float16
    O1/O2), ``"dynamic"``, a number (a static scale; overflowing steps are
    skipped), a :class:`mixprec.loss_scale.LossScale`, or a MindSpore-style
    :class:`mixprec.managers.LossScaleManager` (``FixedLossScaleManager(S, False)``
    applies overflowing steps instead of skipping them, as in MindSpore).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> step = build_train_network(
    ...     net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
    ...     "O2", loss_scale_manager=128.0, dtype=torch.bfloat16)
    >>> loss = step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> loss.dtype, float(step.optimizer.loss_scale), net[0].weight.dtype
    (torch.float32, 128.0, torch.bfloat16)
    """
    check_module("network", network)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    from mixprec.managers import LossScaleManager

    drop_overflow_update = True
    if isinstance(loss_scale_manager, LossScaleManager):
        drop_overflow_update = loss_scale_manager.get_drop_overflow_update()
        loss_scale_manager = loss_scale_manager.build_loss_scale()
    model, wrapped = initialize(
        network,
        optimizer,
        level,
        dtype=dtype,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        loss_scale=loss_scale_manager,
    )
    if not drop_overflow_update:
        wrapped.skip_nonfinite = False
    return TrainStep(model, wrapped, loss_fn)
