"""``loss_scale_from_spec``: the one parser of a user's loss-scale choice."""

from __future__ import annotations

from typing import Any

from mixprec.loss_scale.base import LossScale, NoOpLossScale, StaticLossScale, _positive
from mixprec.loss_scale.dynamic import DynamicLossScale

__all__ = ["loss_scale_from_spec"]


def loss_scale_from_spec(spec: Any) -> LossScale:
    """Turn a user's loss-scale choice into a :class:`LossScale`.

    Accepts a ``LossScale`` (returned as is), ``"dynamic"``, ``"none"``/``None``,
    or a positive number (a static scale).

    >>> loss_scale_from_spec(128)
    StaticLossScale(loss_scale=128.0)
    >>> loss_scale_from_spec("dynamic").kind
    'dynamic'
    """
    if isinstance(spec, LossScale):
        return spec
    if spec is None or spec == "none":
        return NoOpLossScale()
    if spec == "dynamic":
        return DynamicLossScale()
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        _positive("loss_scale", spec)
        return StaticLossScale(float(spec))
    error = TypeError if not isinstance(spec, str) else ValueError
    raise error(
        f"loss_scale must be 'dynamic', 'none', None, a positive number or a "
        f"mixprec.LossScale object, got {spec!r}"
    )
