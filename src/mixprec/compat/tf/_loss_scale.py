"""TensorFlow's ``DynamicLossScale`` and ``FixedLossScale``: the core loss scales with
TF's argument names, ``__call__``, ``update(grads)``, configs and reprs.

>>> import torch
>>> ls = DynamicLossScale(initial_loss_scale=8.0, increment_period=2, multiplier=4.0)
>>> float(ls())
8.0
>>> bool(ls.update([torch.tensor(float("inf"))])), float(ls())   # skip, divide by 4
(False, 2.0)
>>> ls
DynamicLossScale(current_loss_scale=2.0, num_good_steps=0, initial_loss_scale=8.0, \
increment_period=2, multiplier=4.0)
>>> FixedLossScale(123)
FixedLossScale(123.0)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mixprec import loss_scale as core
from mixprec._checks import check_number
from mixprec.numerics import any_nonfinite


def _flatten(grads: Any) -> list[Any]:
    """The leaves of a nested list/tuple/dict of gradients (TF's ``nest.flatten``)."""
    if isinstance(grads, Mapping):
        return [leaf for value in grads.values() for leaf in _flatten(value)]
    if grads is None or isinstance(grads, (torch.Tensor, str, bytes)):
        return [grads]
    if isinstance(grads, Iterable):
        return [leaf for item in grads for leaf in _flatten(item)]
    return [grads]


def _numpy_str(value: torch.Tensor) -> str:
    # TF prints its state variables with ``%s`` of ``.numpy()``; numpy's float32
    # printing is the same here (1.0, 32768.0, 1.0737418e+09).
    return str(value.detach().cpu().numpy())


class _TFLossScaleMixin:
    """``__call__`` and ``update(grads)`` of TF's ``LossScale`` classes."""

    def __call__(self) -> torch.Tensor:
        """The current loss scale, a float32 scalar tensor."""
        return self.scale

    def update(self, grads: Any = None, *, found_inf: torch.Tensor | None = None) -> Any:
        """Update the scale from ``grads``: a tensor or a nested list/tuple/dict of (unscaled)
        gradients, ``None`` allowed.

        Returns ``should_apply_gradients``: a bool tensor, False when any gradient is
        non-finite. Gradients are only checked, not changed. No host sync. (The core
        optimizers call ``update(found_inf=flag)``, the core's transition.)
        """
        if found_inf is not None:
            return super().update(found_inf)
        leaves = [g for g in _flatten(grads) if g is not None]
        for g in leaves:
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"grads must hold tensors or None, got {type(g).__name__}")
        flag = any_nonfinite(leaves, self.scale.device)
        super().update(flag)
        return flag == 0


class DynamicLossScale(_TFLossScaleMixin, core.DynamicLossScale):
    """``tf.train.experimental.DynamicLossScale``: TF 1.15's rule over the core one.

    Every ``increment_period`` consecutive finite steps the scale is multiplied by
    ``multiplier``; on a non-finite gradient the count resets and the scale is
    divided by ``multiplier`` (never below 1, as TF does). No ceiling: growth stops
    only where the scale would become infinite. ``repr`` is TF's eager one, with the
    current scale and count (reading them syncs).
    """

    def __init__(
        self,
        initial_loss_scale: float = 2.0**15,
        increment_period: int = 2000,
        multiplier: float = 2.0,
    ) -> None:
        check_number("initial_loss_scale", initial_loss_scale, minimum=1)
        check_number("increment_period", increment_period, integer=True, minimum=1)
        check_number("multiplier", multiplier, minimum=1, exclusive=True)
        super().__init__(
            **core.DynamicLossScale.symmetric_config(
                initial_loss_scale, increment_period, multiplier
            )
        )

    @property
    def initial_loss_scale(self) -> float:
        return float(self.initial_scale)

    @property
    def increment_period(self) -> int:
        return self.growth_interval

    @property
    def multiplier(self) -> float:
        return self.growth_factor

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_loss_scale": self.initial_loss_scale,
            "increment_period": self.increment_period,
            "multiplier": self.multiplier,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DynamicLossScale:
        return cls(**config)

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(current_loss_scale={_numpy_str(self.scale)}, "
            f"num_good_steps={_numpy_str(self.counter)}, "
            f"initial_loss_scale={self.initial_loss_scale}, "
            f"increment_period={self.increment_period}, multiplier={self.multiplier})"
        )


class FixedLossScale(_TFLossScaleMixin, core.StaticLossScale):
    """``tf.train.experimental.FixedLossScale(loss_scale_value)``: a scale that never changes.

    ``update(grads)`` changes nothing and reports whether the gradients are finite
    (TF returned ``True`` unconditionally; mixprec optimizers skip non-finite steps
    for every kind of loss scale, so the flag says what will happen).
    """

    def __init__(self, loss_scale_value: float) -> None:
        check_number("loss_scale_value", loss_scale_value, minimum=0, exclusive=True)
        super().__init__(loss_scale_value)

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": float(self.loss_scale)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FixedLossScale:
        return cls(**config)

    def __repr__(self) -> str:
        return f"FixedLossScale({float(self.loss_scale)})"


_CLASSES = {"DynamicLossScale": DynamicLossScale, "FixedLossScale": FixedLossScale}


def loss_scale_config(loss_scale: core.LossScale) -> dict[str, Any]:
    """TF's serialized form of a TF loss scale: ``{"class_name": ..., "config": ...}``."""
    return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def loss_scale_from_config(serialized: Any) -> core.LossScale:
    """Undo :func:`loss_scale_config` (TF's ``loss_scale.deserialize``)."""
    if not (isinstance(serialized, Mapping) and serialized.get("class_name") in _CLASSES):
        raise ValueError(
            f"a serialized loss scale is {{'class_name': 'DynamicLossScale' or "
            f"'FixedLossScale', 'config': {{...}}}}, got {serialized!r}"
        )
    return _CLASSES[serialized["class_name"]].from_config(serialized.get("config", {}))
