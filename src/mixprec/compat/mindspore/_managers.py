"""Loss-scale managers with MindSpore's names and defaults, over the core loss scales.

A manager holds one core :class:`~mixprec.loss_scale.LossScale` and tracks its value:
``update_loss_scale(overflow)`` advances it by one step, ``get_loss_scale()`` reads
it, ``get_update_cell()`` gives the update cell a training cell runs, and
``build_loss_scale()`` a fresh core loss scale starting from the current value (what
:class:`mixprec.compat.mindspore.Model` trains with). The rule is the core's.

* ``FixedLossScaleManager(loss_scale=128.0, drop_overflow_update=True)``: a static
  scale. With ``drop_overflow_update=False`` the update is applied even when the
  gradients overflowed, as MindSpore does (the optimizer then sees the inf/NaN).
* ``DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=2, scale_window=2000)``:
  divide by ``scale_factor`` on overflow (never below 1), multiply by it after
  ``scale_window`` finite steps; overflowing steps are always dropped. More than
  ``bad_step_max`` (1000) overflows in a row raise ``RuntimeError``, as in MindSpore.

>>> m = DynamicLossScaleManager(scale_factor=4, scale_window=3000)
>>> ls = m.build_loss_scale()
>>> float(ls.scale), ls.growth_interval, ls.growth_factor, ls.backoff_factor
(16777216.0, 3000, 4.0, 0.25)
>>> m.update_loss_scale(True); m.get_loss_scale()
4194304.0
>>> FixedLossScaleManager(1024.0, False).get_drop_overflow_update()
False
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._checks import check_bool, check_number
from mixprec.compat.mindspore._loss_scale_cells import (
    DynamicLossScaleUpdateCell,
    FixedLossScaleUpdateCell,
    _overflow_flag,
)
from mixprec.loss_scale import DynamicLossScale, LossScale, StaticLossScale, loss_scale_from_spec


class LossScaleManager:
    """What every manager offers: the current scale, its update, and the overflow policy."""

    drop_overflow_update: bool = True
    _loss_scale: LossScale

    def build_loss_scale(self) -> LossScale:
        """A new loss-scale state machine with this manager's rule, at the current value."""
        raise TypeError(f"{type(self).__name__} does not describe a loss scale")

    def get_loss_scale(self) -> float:
        """The current loss scale (reading it syncs)."""
        return float(self._loss_scale.scale)

    def update_loss_scale(self, overflow: Any) -> None:
        """Advance the scale by one step: ``overflow`` is a bool or a one-element tensor."""
        self._loss_scale.update(_overflow_flag(overflow, self._loss_scale.device))

    def get_update_cell(self) -> nn.Module | None:
        """The cell that updates the scale in a training cell (``None``: nothing to update)."""
        raise TypeError(f"{type(self).__name__} has no update cell")

    def get_drop_overflow_update(self) -> bool:
        return self.drop_overflow_update


class FixedLossScaleManager(LossScaleManager):
    """A fixed loss scale; ``drop_overflow_update`` chooses whether overflowing steps are skipped."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        check_number("loss_scale", loss_scale, minimum=1)
        check_bool("drop_overflow_update", drop_overflow_update)
        self.loss_scale = float(loss_scale)
        self.drop_overflow_update = drop_overflow_update
        self._loss_scale = StaticLossScale(self.loss_scale)

    def build_loss_scale(self) -> LossScale:
        return StaticLossScale(self.loss_scale)

    def update_loss_scale(self, overflow: Any) -> None:
        """Nothing changes (MindSpore's fixed manager); ``overflow`` is still checked."""
        _overflow_flag(overflow, torch.device("cpu"))

    def get_update_cell(self) -> FixedLossScaleUpdateCell | None:
        """``None`` with ``drop_overflow_update=False`` (nothing to check), as in MindSpore."""
        if not self.drop_overflow_update:
            return None
        return FixedLossScaleUpdateCell(self.loss_scale)

    def __repr__(self) -> str:
        return (
            f"FixedLossScaleManager(loss_scale={self.loss_scale!r}, "
            f"drop_overflow_update={self.drop_overflow_update!r})"
        )


class DynamicLossScaleManager(LossScaleManager):
    """A dynamic loss scale with MindSpore's parameters (see the module docstring).

    Note: MindSpore's positional order is ``(init_loss_scale, scale_factor,
    scale_window)``; pass ``scale_factor``/``scale_window`` by keyword.
    """

    #: Overflowing updates in a row after which ``update_loss_scale`` raises (MindSpore's).
    bad_step_max = 1000

    def __init__(
        self, init_loss_scale: float = 2.0**24, scale_factor: float = 2, scale_window: int = 2000
    ) -> None:
        check_number("init_loss_scale", init_loss_scale, minimum=1)
        check_number("scale_factor", scale_factor, minimum=1, exclusive=True)
        check_number("scale_window", scale_window, integer=True, minimum=1)
        self.init_loss_scale = init_loss_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self._loss_scale = self._rule(init_loss_scale)

    def _rule(self, initial: float) -> DynamicLossScale:
        return DynamicLossScale(
            **DynamicLossScale.symmetric_config(initial, self.scale_window, self.scale_factor)
        )

    @property
    def loss_scale(self) -> float:
        """The current loss scale (MindSpore's attribute)."""
        return self.get_loss_scale()

    def update_loss_scale(self, overflow: Any) -> None:
        super().update_loss_scale(overflow)
        streak = int(self._loss_scale.inf_streak)
        if streak > self.bad_step_max:
            raise RuntimeError(
                f"Dynamic loss scale Continuous overflow {streak} times, has exceeded maximum "
                f"threshold {self.bad_step_max}: the gradients overflow at every scale; lower "
                "the learning rate or check the data for inf/NaN"
            )

    def build_loss_scale(self) -> LossScale:
        return self._rule(self.get_loss_scale())

    def get_update_cell(self) -> DynamicLossScaleUpdateCell:
        """A ``DynamicLossScaleUpdateCell`` at the current scale, as MindSpore's."""
        return DynamicLossScaleUpdateCell(
            self.get_loss_scale(), self.scale_factor, self.scale_window
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaleManager(init_loss_scale={self.init_loss_scale!r}, "
            f"scale_factor={self.scale_factor!r}, scale_window={self.scale_window!r})"
        )


def resolve_loss_scale(spec: Any) -> tuple[LossScale, bool]:
    """Turn a manager, a ``LossScale``, ``"dynamic"``, ``"none"``/``None`` or a number into
    ``(loss_scale, drop_overflow_update)``.

    >>> ls, drop = resolve_loss_scale(FixedLossScaleManager(64.0, False))
    >>> float(ls.scale), drop
    (64.0, False)
    """
    if isinstance(spec, LossScaleManager):
        return spec.build_loss_scale(), spec.drop_overflow_update
    return loss_scale_from_spec(spec), True
