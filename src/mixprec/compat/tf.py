"""TensorFlow's mixed-precision names, over the mixprec core.

>>> import torch
>>> from mixprec.compat.tf import DynamicLossScale, LossScaleOptimizer
>>> ls = DynamicLossScale(initial_loss_scale=8.0, increment_period=2, multiplier=4.0)
>>> float(ls())
8.0
>>> bool(ls.update([torch.tensor(float("inf"))])), float(ls())   # skip, divide by 4
(False, 2.0)
>>> var = torch.tensor(1.0, requires_grad=True)
>>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
>>> _ = opt.minimize(lambda: var**2, var_list=[var]); float(var.detach())
0.5
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mixprec import loss_scale as core
from mixprec.numerics import unscale_and_check_
from mixprec.optim import LossScaleOptimizer as _CoreLossScaleOptimizer
from mixprec.policy import global_policy

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "enable_mixed_precision_graph_rewrite",
]


def _all_finite(grads: Iterable[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """1.0 if any gradient holds inf/NaN (checked with the fused kernel, nothing changed)."""
    one = torch.ones((), dtype=torch.float32, device=device)
    return unscale_and_check_([g.detach().clone() for g in grads if g is not None], one)


def _flatten(grads: Any) -> list[Any]:
    """The leaves of a nested list/tuple/dict of gradients (TF's ``nest.flatten``)."""
    if isinstance(grads, Mapping):
        return [leaf for value in grads.values() for leaf in _flatten(value)]
    if grads is None or isinstance(grads, (torch.Tensor, str, bytes)):
        return [grads]
    if isinstance(grads, Iterable):
        return [leaf for item in grads for leaf in _flatten(item)]
    return [grads]


class _TFLossScaleMixin:
    """``__call__`` and ``update(grads)`` of TF's ``LossScale`` classes."""

    def __call__(self) -> torch.Tensor:
        """The current loss scale, a float32 scalar tensor."""
        return self.scale

    def update(self, grads: Any) -> torch.Tensor:
        """Update the scale from ``grads``: a tensor or a nested list/tuple/dict of (unscaled)
        gradients, ``None`` allowed.

        Returns ``should_apply_gradients``: a bool tensor, False when any gradient is
        non-finite. Gradients are only checked, not changed. No host sync.
        """
        grads = _flatten(grads)
        for g in grads:
            if g is not None and not isinstance(g, torch.Tensor):
                raise TypeError(f"grads must hold tensors or None, got {type(g).__name__}")
        found_inf = _all_finite(grads, self.scale.device)
        self.advance(found_inf)
        return found_inf == 0


class DynamicLossScale(_TFLossScaleMixin, core.DynamicLossScale):
    """``tf.train.experimental.DynamicLossScale``: TF 1.15's rule over the core one.

    Every ``increment_period`` consecutive finite steps the scale is multiplied by
    ``multiplier``; on a non-finite gradient the count resets and the scale is
    divided by ``multiplier`` (never below 1, as TF does). No ceiling: growth stops
    only where the scale would become infinite.
    """

    def __init__(
        self,
        initial_loss_scale: float = 2.0**15,
        increment_period: int = 2000,
        multiplier: float = 2.0,
    ) -> None:
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, numbers.Real)
            or multiplier <= 1
        ):
            raise ValueError(f"multiplier must be a number > 1, got {multiplier!r}")
        try:
            super().__init__(
                initial_scale=initial_loss_scale,
                growth_interval=increment_period,
                growth_factor=float(multiplier),
                backoff_factor=1.0 / float(multiplier),
                min_scale=1.0,
                max_scale=None,
            )
        except (TypeError, ValueError) as err:
            msg = str(err).replace("initial_scale", "initial_loss_scale")
            raise type(err)(msg.replace("growth_interval", "increment_period")) from None

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
            f"DynamicLossScale(initial_loss_scale={self.initial_loss_scale!r}, "
            f"increment_period={self.increment_period!r}, multiplier={self.multiplier!r})"
        )


class FixedLossScale(_TFLossScaleMixin, core.StaticLossScale):
    """``tf.train.experimental.FixedLossScale(loss_scale_value)``: a scale that never changes.

    ``update(grads)`` changes nothing and reports whether the gradients are finite
    (TF returned ``True`` unconditionally; mixprec optimizers skip non-finite steps
    for every kind of loss scale, so the flag says what will happen).
    """

    def __init__(self, loss_scale_value: float) -> None:
        try:
            super().__init__(loss_scale_value)
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("loss_scale", "loss_scale_value")) from None

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": float(self.loss_scale)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FixedLossScale:
        return cls(**config)

    def __repr__(self) -> str:
        return f"FixedLossScale(loss_scale_value={float(self.loss_scale)!r})"


class LossScaleOptimizer(_CoreLossScaleOptimizer):
    """``tf.keras.mixed_precision.LossScaleOptimizer`` (TF 2): TF's defaults and rule.

    ``LossScaleOptimizer(inner_optimizer, dynamic=True, initial_scale=None,
    dynamic_growth_steps=None)``: dynamic by default, starting at 2**15 and doubling
    every 2000 finite steps; halved (never below 1) and the step skipped on a
    non-finite gradient; no ceiling. ``dynamic=False`` needs ``initial_scale``.

    ``iterations`` counts *applied* steps only: the TF 2.3 graph-rewrite guide says
    the global step is not incremented on a skipped step, and that is the count a
    learning-rate schedule wants. (TF 2's own ``iterations`` also counted skipped
    steps; ``iterations + skipped_steps`` gives that number.)
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
    ) -> None:
        if dynamic is True:
            growth = 2000 if dynamic_growth_steps is None else dynamic_growth_steps
            try:
                loss_scale = DynamicLossScale(
                    2.0**15 if initial_scale is None else initial_scale, growth, 2.0
                )
            except (TypeError, ValueError) as err:
                msg = str(err).replace("initial_loss_scale", "initial_scale")
                raise type(err)(msg.replace("increment_period", "dynamic_growth_steps")) from None
            super().__init__(inner_optimizer, loss_scale=loss_scale)
        else:
            super().__init__(inner_optimizer, dynamic, initial_scale, dynamic_growth_steps)

    @classmethod
    def _with_loss_scale(
        cls, inner_optimizer: torch.optim.Optimizer, loss_scale: core.LossScale
    ) -> LossScaleOptimizer:
        """The optimizer over a given loss-scale object (TF 2.3's ``loss_scale=`` argument)."""
        self = cls.__new__(cls)
        _CoreLossScaleOptimizer.__init__(self, inner_optimizer, loss_scale=loss_scale)
        return self


def enable_mixed_precision_graph_rewrite(
    opt: torch.optim.Optimizer,
    loss_scale: Any = "dynamic",
    *,
    model: torch.nn.Module | None = None,
    example_inputs: Any = None,
    dtype: torch.dtype = torch.float16,
) -> Any:
    """``tf.train.experimental.enable_mixed_precision_graph_rewrite(opt, loss_scale)``.

    Wraps ``opt`` in a :class:`LossScaleOptimizer` with ``loss_scale``: ``"dynamic"``
    (the default), an int/float (a fixed scale) or a loss-scale object. TF rewrote
    every graph built afterwards; in PyTorch the graph comes from a model, so pass
    ``model=`` and ``example_inputs=`` to get ``(rewritten_model, optimizer)`` from
    :func:`mixprec.rewrite.rewrite`; without them the wrapped optimizer alone is
    returned, as TF returns it. Raises ``ValueError`` if a mixed global policy is
    set (only one of the two mixed-precision APIs can be used).
    """
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"opt must be a torch.optim.Optimizer, got {type(opt).__name__}")
    if global_policy().compute_dtype != torch.float32:
        raise ValueError(
            f"the global policy is {global_policy()}; the graph rewrite and the policy API cannot "
            "both be used: set_global_policy('float32') first"
        )
    if loss_scale == "dynamic":
        wrapped = LossScaleOptimizer(opt)
    elif isinstance(loss_scale, core.LossScale):
        wrapped = LossScaleOptimizer._with_loss_scale(opt, loss_scale)
    elif isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):
        wrapped = LossScaleOptimizer(opt, dynamic=False, initial_scale=float(loss_scale))
    else:
        raise ValueError(
            f"loss_scale must be 'dynamic', an int/float or a loss-scale object, got {loss_scale!r}"
        )
    if model is None:
        if example_inputs is not None:
            raise ValueError("example_inputs were given without model=; pass both or neither")
        return wrapped
    if example_inputs is None:
        raise ValueError("model= needs example_inputs=, the arguments of one forward call")
    from mixprec.rewrite import rewrite

    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    return rewrite(model, args, dtype=dtype), wrapped
