"""MindSpore's loss-scale cells, over the core loss scales.

* ``FixedLossScaleUpdateCell(loss_scale_value)`` and
  ``DynamicLossScaleUpdateCell(loss_scale_value, scale_factor, scale_window)``: called
  as ``cell(loss_scale, overflow)`` they update the ``loss_scale`` tensor in place and
  return ``overflow``; ``get_loss_scale()`` is the value they were built with. The
  dynamic rule is the core :class:`~mixprec.loss_scale.DynamicLossScale`'s (``loss_scaler``).
* ``TrainOneStepWithLossScaleCell(network, optimizer, scale_sense)``: one step that
  returns ``(loss, overflow, scale)``; ``scale_sense`` is an update cell (the scale
  changes) or a one-element tensor (a fixed scale). The step is the core
  :class:`~mixprec.optim.LossScaleOptimizer`'s: scale, unscale, check, skip or apply,
  update.

>>> import torch
>>> cell = DynamicLossScaleUpdateCell(loss_scale_value=2.0**12, scale_factor=2, scale_window=2)
>>> scale = torch.tensor(2.0**12)
>>> [bool(cell(scale, torch.tensor(o))) for o in (True, False, False)], float(scale)
([True, False, False], 4096.0)
>>> from mixprec.compat.mindspore import WithLossCell
>>> net = torch.nn.Sequential(torch.nn.Linear(3, 1))
>>> step = TrainOneStepWithLossScaleCell(
...     WithLossCell(net, torch.nn.functional.mse_loss), torch.optim.SGD(net.parameters(), 0.1),
...     scale_sense=DynamicLossScaleUpdateCell(1024.0, 2, 1000))
>>> loss, overflow, used = step(torch.ones(4, 3), torch.zeros(4, 1))
>>> bool(overflow), float(used), float(step.scale_sense)
(False, 1024.0, 1024.0)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from mixprec._checks import check_instance, check_number
from mixprec.loss_scale import DynamicLossScale, LossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.train._step import TrainStep


def _overflow_flag(overflow: Any, device: torch.device) -> torch.Tensor:
    """``overflow`` (a bool or a one-element tensor) as the core's 0/1 float flag."""
    if isinstance(overflow, torch.Tensor):
        if overflow.numel() != 1:
            raise ValueError(
                f"overflow must be a one-element tensor, got shape {tuple(overflow.shape)}"
            )
        return overflow.detach().reshape(()).to(device, torch.float32)
    if isinstance(overflow, (bool, np.bool_)):
        return torch.tensor(float(overflow), device=device)
    raise TypeError(f"overflow must be a bool or a bool tensor, got {type(overflow).__name__}")


def _check_scale_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"The input type must be Tensor, but got {type(value).__name__}")
    if value.shape not in ((), (1,)):
        raise ValueError(f"The shape of '{name}' must be (1,) or (), but got {tuple(value.shape)}")
    return value


class _UpdateCell(nn.Module):
    """What both update cells share: the core loss scale they run, and its state."""

    loss_scaler: LossScale

    def __init__(self, loss_scale_value: float) -> None:
        super().__init__()
        check_number("loss_scale_value", loss_scale_value, minimum=1)
        self.loss_scale_value = loss_scale_value

    def get_loss_scale(self) -> float:
        """The loss scale this cell was built with (MindSpore's ``get_loss_scale``)."""
        return self.loss_scale_value

    def forward(self, loss_scale: torch.Tensor, overflow: Any) -> Any:
        """Advance the rule by one step: ``loss_scale`` (the current scale) is updated in
        place; returns ``overflow``. No host sync."""
        _check_scale_tensor("loss_scale", loss_scale)
        ls = self.loss_scaler
        if ls.device != loss_scale.device:
            ls.to(loss_scale.device)
        if loss_scale is not ls.scale:  # a scale held elsewhere: run the rule on its value
            ls.scale.copy_(loss_scale.detach().reshape(()))
        ls.update(_overflow_flag(overflow, ls.device))
        if loss_scale is not ls.scale:
            with torch.no_grad():
                loss_scale.copy_(ls.scale.reshape(loss_scale.shape))
        return overflow

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return self.loss_scaler.state_dict()

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.loss_scaler.load_state_dict(state)


class FixedLossScaleUpdateCell(_UpdateCell):
    """``nn.FixedLossScaleUpdateCell(loss_scale_value)``: the scale never changes."""

    def __init__(self, loss_scale_value: float) -> None:
        super().__init__(loss_scale_value)
        self.loss_scaler = StaticLossScale(float(loss_scale_value))

    def forward(self, loss_scale: torch.Tensor, overflow: Any) -> Any:
        """Returns ``overflow``; ``loss_scale`` is left as it is."""
        _check_scale_tensor("loss_scale", loss_scale)
        return overflow


class DynamicLossScaleUpdateCell(_UpdateCell):
    """``nn.DynamicLossScaleUpdateCell(loss_scale_value, scale_factor, scale_window)``.

    On overflow the scale is divided by ``scale_factor`` (never below 1); after
    ``scale_window`` steps without one it is multiplied by it. The rule is the core
    :class:`~mixprec.loss_scale.DynamicLossScale` (``loss_scaler``), whose counter is
    this cell's state (``state_dict()`` keeps it).
    """

    def __init__(self, loss_scale_value: float, scale_factor: float, scale_window: int) -> None:
        super().__init__(loss_scale_value)
        check_number("scale_factor", scale_factor, minimum=1, exclusive=True)
        check_number("scale_window", scale_window, integer=True, minimum=1)
        self.scale_factor, self.scale_window = scale_factor, scale_window
        self.loss_scaler = DynamicLossScale(
            **DynamicLossScale.symmetric_config(float(loss_scale_value), scale_window, scale_factor)
        )


class TrainOneStepWithLossScaleCell(TrainStep):
    """``nn.TrainOneStepWithLossScaleCell(network, optimizer, scale_sense)``.

    ``network`` returns the loss (e.g. :class:`WithLossCell`). ``scale_sense`` is an
    update cell, whose core loss scale the step then runs (its state is the cell's),
    or a tensor of shape ``()`` or ``(1,)``, a fixed scale. A call returns ``(loss,
    overflow, scale)``: the float32 loss, whether the step overflowed (and so was
    skipped), and the scale it used. ``scale_sense`` reads the current scale and
    :meth:`set_sense_scale` sets it.

    Algorithm (the core optimizer's step)::

        zero_grad; loss = network(*inputs)
        backward of loss * scale; unscale and check (one fused kernel)
        overflow: skip the step, else optimizer step; the update cell's rule advances
    """

    def __init__(
        self, network: nn.Module, optimizer: torch.optim.Optimizer, scale_sense: Any
    ) -> None:
        check_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        if isinstance(optimizer, LossScaleOptimizer):
            raise ValueError(
                "optimizer is already a LossScaleOptimizer; pass the plain optimizer: "
                "scale_sense gives the loss scaling"
            )
        if isinstance(scale_sense, _UpdateCell):
            loss_scale = scale_sense.loss_scaler
        elif isinstance(scale_sense, torch.Tensor):
            value = float(_check_scale_tensor("scale_sense", scale_sense).reshape(()))
            check_number("scale_sense", value, minimum=0, exclusive=True)
            loss_scale = StaticLossScale(value)
        else:
            raise TypeError(
                f"The 'scale_sense' must be Cell or Tensor, but got {type(scale_sense).__name__}"
            )
        super().__init__(network, LossScaleOptimizer(optimizer, loss_scale=loss_scale))
        self.network = network
        self.loss_scaling_manager = scale_sense if isinstance(scale_sense, _UpdateCell) else None

    @property
    def scale_sense(self) -> torch.Tensor:
        """The current loss scale (a float32 scalar tensor)."""
        return self.optimizer.loss_scale

    def set_sense_scale(self, sens: torch.Tensor) -> None:
        """Set the current loss scale (MindSpore's ``set_sense_scale``)."""
        value = _check_scale_tensor("sens", sens).detach().reshape(())
        self.optimizer.loss_scaler.scale.copy_(value)

    def __call__(self, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = self.scale_sense.detach().clone()
        loss = super().__call__(*inputs)
        return loss, self.optimizer.last_step_skipped, scale
