"""TensorFlow's mixed-precision names, over the mixprec core.

``DynamicLossScale``/``FixedLossScale`` are the core loss scales with TF's argument
names, ``__call__`` and ``update(grads)``; ``LossScaleOptimizer`` is the core optimizer
with TF 2's constructor and its ``minimize``/``get_scaled_loss``/
``get_unscaled_gradients``/``apply_gradients``; ``enable_mixed_precision_graph_rewrite``
wraps an optimizer (and, given a model, rewrites it with :func:`mixprec.rewrite.rewrite`).

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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec import loss_scale as core
from mixprec._checks import check_bool, check_instance, check_number
from mixprec.numerics import any_nonfinite
from mixprec.optim import LossScaleOptimizer as _CoreLossScaleOptimizer
from mixprec.policy import global_policy

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "enable_mixed_precision_graph_rewrite",
]


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
    only where the scale would become infinite.
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
        check_number("loss_scale_value", loss_scale_value, minimum=0, exclusive=True)
        super().__init__(loss_scale_value)

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": float(self.loss_scale)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FixedLossScale:
        return cls(**config)

    def __repr__(self) -> str:
        return f"FixedLossScale(loss_scale_value={float(self.loss_scale)!r})"


class TFOptimizerAPI:
    """TensorFlow's optimizer methods and attributes, for a core ``LossScaleOptimizer``."""

    @property
    def dynamic(self) -> bool:
        return isinstance(self.loss_scaler, core.DynamicLossScale)

    @property
    def initial_scale(self) -> float:
        ls = self.loss_scaler
        if isinstance(ls, core.DynamicLossScale):
            return float(ls.initial_scale)
        return float(ls.loss_scale) if isinstance(ls, core.StaticLossScale) else 1.0

    @property
    def dynamic_growth_steps(self) -> int | None:
        return self.loss_scaler.growth_interval if self.dynamic else None

    @property
    def dynamic_counter(self) -> torch.Tensor | None:
        """Finite steps since the scale last changed (``None`` unless dynamic)."""
        return self.loss_scaler.counter if self.dynamic else None

    def get_scaled_loss(self, loss: torch.Tensor | Callable[[], torch.Tensor]) -> Any:
        """TF spelling of ``scale_loss``; a callable gives a callable back."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(
        self, grads: Iterable[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """A new list with every gradient divided by the scale; ``None`` entries kept."""
        inv = self.loss_scaler.inv_scale(self._factor())
        # In float32: 1/scale underflows float16 for scales above 2**24.
        return [None if g is None else (g.float() * inv.to(g.device)).to(g.dtype) for g in grads]

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]
    ) -> None:
        """Apply already-unscaled gradients to their parameters (TF 2's ``apply_gradients``).

        Only the listed parameters are updated. The step is skipped if any gradient is
        non-finite, and the loss scale is updated either way.
        """
        self._apply_pairs(grads_and_vars, scaled=False)

    def _apply_pairs(
        self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]], scaled: bool
    ) -> None:
        """Step on these gradients (scaled or not) in ``.grad``; the old ones come back after."""
        pairs = list(grads_and_vars)
        own = self.model_params()
        own_ids = {id(p) for p in own}
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise TypeError(f"grads_and_vars[{i}] must be a (grad, param) pair, got {pair!r}")
            g, p = pair
            if id(p) not in own_ids:
                raise ValueError(
                    f"grads_and_vars[{i}] names a tensor of shape {tuple(p.shape)} that this "
                    "optimizer does not hold; build the inner optimizer over it first"
                )
            if g is not None and g.shape != p.shape:
                raise ValueError(
                    f"grads_and_vars[{i}]: gradient shape {tuple(g.shape)} does not match "
                    f"parameter shape {tuple(p.shape)}"
                )
        saved = {id(p): p.grad for p in own}
        for p in own:
            p.grad = None
        for g, p in pairs:
            # A private copy: the step unscales in place, and g may be shared or expanded.
            p.grad = None if g is None else g.detach().to(p.dtype, copy=True).contiguous()
        if scaled:  # gradients of a scaled loss, handed over by the caller
            self.loss_scaler.mark_scaled()
        try:
            self._step(unscaled=not scaled)
        finally:
            for p in own:
                p.grad = saved[id(p)]

    def minimize(
        self,
        loss: torch.Tensor | Callable[[], torch.Tensor],
        var_list: Iterable[torch.Tensor] | torch.Tensor,
    ) -> torch.Tensor:
        """Scale, differentiate, unscale, apply and update in one call; returns the loss."""
        var_list = [var_list] if isinstance(var_list, torch.Tensor) else list(var_list)
        with torch.enable_grad():
            value = loss() if callable(loss) else loss
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"loss must be a tensor or return one, got {type(value).__name__}")
            scaled_grads = torch.autograd.grad(self.scale_loss(value), var_list, allow_unused=True)
        # The step unscales the scaled gradients in float32 (into the masters under master
        # weights); unscaling here, in float16, would flush small gradients to zero first.
        self._apply_pairs(list(zip(scaled_grads, var_list)), scaled=True)
        return value.detach()


class LossScaleOptimizer(TFOptimizerAPI, _CoreLossScaleOptimizer):
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
        check_bool("dynamic", dynamic)
        if dynamic:
            check_number("initial_scale", initial_scale, minimum=1, allow_none=True)
            check_number(
                "dynamic_growth_steps", dynamic_growth_steps, integer=True, minimum=1,
                allow_none=True,
            )  # fmt: skip
            loss_scale: core.LossScale = DynamicLossScale(
                2.0**15 if initial_scale is None else initial_scale,
                2000 if dynamic_growth_steps is None else dynamic_growth_steps,
                2.0,
            )
        else:
            if initial_scale is None:
                raise ValueError(
                    "dynamic=False needs initial_scale, the fixed loss scale to use "
                    "(e.g. LossScaleOptimizer(opt, dynamic=False, initial_scale=128))"
                )
            if dynamic_growth_steps is not None:
                raise ValueError(
                    f"dynamic_growth_steps={dynamic_growth_steps!r} can only be set when "
                    "dynamic=True"
                )
            check_number("initial_scale", initial_scale, minimum=0, exclusive=True)
            loss_scale = FixedLossScale(initial_scale)
        super().__init__(inner_optimizer, loss_scale)

    @classmethod
    def _with_loss_scale(
        cls, inner_optimizer: torch.optim.Optimizer, loss_scale: core.LossScale
    ) -> LossScaleOptimizer:
        """The optimizer over a given loss-scale object (TF 2.3's ``loss_scale=`` argument)."""
        self = cls.__new__(cls)
        _CoreLossScaleOptimizer.__init__(self, inner_optimizer, loss_scale)
        return self


def _check_no_mixed_policy() -> None:
    # As in TensorFlow: a mixed global policy means the policy API is in use, and
    # the two APIs would cast against each other.
    policy = global_policy()
    if policy.compute_dtype != torch.float32 or policy.param_dtype != torch.float32:
        raise ValueError(
            f"the mixed-precision policy API is in use (global policy {str(policy)!r}); only "
            "one mixed-precision API can be used: call mixprec.policy.set_global_policy(None) "
            "(or leave the policy_scope) before enable_mixed_precision_graph_rewrite"
        )


def _wrap(opt: torch.optim.Optimizer, loss_scale: Any) -> LossScaleOptimizer:
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return LossScaleOptimizer(opt)  # TF's rule and defaults
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        check_number("loss_scale", loss_scale, minimum=0, exclusive=True)
        return LossScaleOptimizer(opt, dynamic=False, initial_scale=float(loss_scale))
    if isinstance(loss_scale, core.LossScale):
        return LossScaleOptimizer._with_loss_scale(opt, loss_scale)
    # TensorFlow raises ValueError for any loss_scale it cannot use, whatever its type.
    raise ValueError(
        f"loss_scale must be 'dynamic', a positive number or a mixprec.LossScale, got "
        f"{loss_scale!r} ({type(loss_scale).__name__})"
    )


def enable_mixed_precision_graph_rewrite(
    opt: torch.optim.Optimizer,
    loss_scale: Any = "dynamic",
    *,
    model: nn.Module | None = None,
    example_inputs: Any = None,
    dtype: torch.dtype = torch.float16,
    lists: Any = None,
    level: str = "default",
) -> Any:
    """``tf.train.experimental.enable_mixed_precision_graph_rewrite(opt, loss_scale)``.

    Wraps ``opt`` in a :class:`LossScaleOptimizer` with ``loss_scale``: ``"dynamic"``
    (the default), an int/float (a fixed scale) or a loss-scale object. TF rewrote
    every graph built afterwards; in PyTorch the graph comes from a model, so pass
    ``model=`` and ``example_inputs=`` (the positional arguments of one forward call)
    to get ``(rewritten_model, optimizer)`` from :func:`mixprec.rewrite.rewrite`
    (``dtype``, ``lists`` and ``level`` go to it); without them the wrapped optimizer
    alone is returned, as TF returns it.

    Raises ``ValueError`` if a mixed global policy is set (only one of the two
    mixed-precision APIs can be used), if ``opt`` is already a loss-scale optimizer,
    if it holds none of ``model``'s parameters, or if the model went through another
    mixprec API. A rejected call changes neither the model nor the optimizer.

    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = enable_mixed_precision_graph_rewrite(
    ...     torch.optim.SGD(net.parameters(), lr=0.1), 128, model=net,
    ...     example_inputs=torch.randn(2, 4))
    >>> type(opt.loss_scaler).__name__, model(torch.ones(3, 4)).dtype
    ('FixedLossScale', torch.float32)
    """
    check_instance("opt", opt, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if isinstance(opt, _CoreLossScaleOptimizer):
        raise ValueError(
            "opt is already a LossScaleOptimizer; pass the plain optimizer, which "
            "enable_mixed_precision_graph_rewrite wraps with loss scaling"
        )
    _check_no_mixed_policy()
    if model is None and example_inputs is not None:
        raise ValueError("example_inputs were given without model=; pass both or neither")
    if model is not None and example_inputs is None:
        raise ValueError("model= needs example_inputs=, the arguments of one forward call")
    if isinstance(model, nn.Module):
        own = {id(p) for p in model.parameters()}
        held = [p for group in opt.param_groups for p in group["params"]]
        if held and not any(id(p) in own for p in held):
            raise ValueError(
                "opt holds none of model's parameters; build it on model.parameters() "
                "(the rewritten model trains the same Parameter objects)"
            )
    wrapped = _wrap(opt, loss_scale)
    if model is None:
        return wrapped
    from mixprec.rewrite import rewrite

    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    return rewrite(model, args, dtype=dtype, lists=lists, level=level), wrapped
