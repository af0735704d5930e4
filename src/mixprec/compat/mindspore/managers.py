"""Loss-scale managers with MindSpore's names and defaults, over the core loss scales.

A manager is a recipe, not a second implementation: it builds the
:class:`~mixprec.loss_scale.LossScale` that runs the rule and says whether an
overflowing step is dropped. :class:`mixprec.Model` and ``amp`` take either.

* ``FixedLossScaleManager(loss_scale=128.0, drop_overflow_update=True)``: a static
  scale. With ``drop_overflow_update=False`` the update is applied even when the
  gradients overflowed, as MindSpore does (the optimizer then sees the inf/NaN).
* ``DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=2, scale_window=2000)``:
  divide by ``scale_factor`` on overflow (never below 1), multiply by it after
  ``scale_window`` finite steps; overflowing steps are always dropped.

>>> m = DynamicLossScaleManager(scale_factor=4, scale_window=3000)
>>> ls = m.build_loss_scale()
>>> float(ls.scale), ls.growth_interval, ls.growth_factor, ls.backoff_factor
(16777216.0, 3000, 4.0, 0.25)
>>> FixedLossScaleManager(1024.0, False).get_drop_overflow_update()
False
"""

from __future__ import annotations

from typing import Any

from mixprec._checks import check_bool, check_number
from mixprec.loss_scale import DynamicLossScale, LossScale, StaticLossScale, loss_scale_from_spec

__all__ = [
    "LossScaleManager",
    "FixedLossScaleManager",
    "DynamicLossScaleManager",
    "resolve_loss_scale",
]


class LossScaleManager:
    """What every manager offers: a fresh loss scale and the overflow policy."""

    drop_overflow_update: bool = True

    def build_loss_scale(self) -> LossScale:
        """A new loss-scale state machine configured by this manager."""
        raise TypeError(f"{type(self).__name__} does not describe a loss scale")

    def get_loss_scale(self) -> float:
        """The initial (for fixed managers: the only) loss scale value."""
        return float(self.build_loss_scale().scale)

    def get_drop_overflow_update(self) -> bool:
        return self.drop_overflow_update


class FixedLossScaleManager(LossScaleManager):
    """A fixed loss scale; ``drop_overflow_update`` chooses whether overflowing steps are skipped."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        check_number("loss_scale", loss_scale, minimum=1)
        check_bool("drop_overflow_update", drop_overflow_update)
        self.loss_scale = float(loss_scale)
        self.drop_overflow_update = drop_overflow_update

    def build_loss_scale(self) -> LossScale:
        return StaticLossScale(self.loss_scale)

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

    def __init__(
        self, init_loss_scale: float = 2.0**24, scale_factor: float = 2, scale_window: int = 2000
    ) -> None:
        check_number("init_loss_scale", init_loss_scale, minimum=1)
        check_number("scale_factor", scale_factor, minimum=1, exclusive=True)
        check_number("scale_window", scale_window, integer=True, minimum=1)
        self.init_loss_scale = init_loss_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def build_loss_scale(self) -> LossScale:
        return DynamicLossScale(
            **DynamicLossScale.symmetric_config(
                self.init_loss_scale, self.scale_window, self.scale_factor
            )
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
