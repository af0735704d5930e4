"""TensorFlow 2's ``LossScaleOptimizer``: the core optimizer with TF's constructor,
``minimize``/``get_scaled_loss``/``get_unscaled_gradients``/``apply_gradients`` and
``get_config``/``from_config``.

>>> import torch
>>> var = torch.tensor(1.0, requires_grad=True)
>>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
>>> _ = opt.minimize(lambda: var**2, var_list=[var]); float(var.detach())
0.5
>>> config = opt.get_config()
>>> sorted(config), config["inner_optimizer"]["class_name"]
(['dynamic', 'dynamic_growth_steps', 'initial_scale', 'inner_optimizer'], 'SGD')
>>> LossScaleOptimizer.from_config(config, params=[var]).initial_scale
32768.0
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec import loss_scale as core
from mixprec._checks import check_bool, check_number
from mixprec.compat._optimizer_config import optimizer_config, optimizer_from_config
from mixprec.compat.tf._loss_scale import DynamicLossScale, FixedLossScale, loss_scale_from_config
from mixprec.optim import LossScaleOptimizer as _CoreLossScaleOptimizer


def inner_from_config(
    inner: Any, params: Any, custom_objects: Mapping[str, Any] | None
) -> torch.optim.Optimizer:
    """The inner optimizer of a config: an optimizer object as it is (``params`` must then
    be ``None``), or a serialized one rebuilt over ``params``."""
    if isinstance(inner, torch.optim.Optimizer):
        if params is not None:
            raise ValueError(
                "config['inner_optimizer'] is an optimizer object, which holds its parameters "
                "already: drop params="
            )
        return inner
    return optimizer_from_config(inner, params, custom_objects)


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
        non-finite, and the loss scale is updated either way. A ``None`` gradient leaves
        its parameter alone, with a warning; all of them ``None`` is a ``ValueError``
        ("No gradients provided for any variable."), and nothing changes.
        """
        self._apply_pairs(grads_and_vars, scaled=False)

    def _apply_pairs(
        self,
        grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]],
        scaled: bool,
        where: str = "grads_and_vars",
    ) -> None:
        """Step with the given gradients, still scaled or already unscaled: they stand in
        ``.grad`` for the one step, and the gradients that were there come back after.

        As TensorFlow and Keras filter empty gradients: none at all is a ``ValueError``
        (before anything changes: no step is counted and the scale does not move), and
        variables without one get a warning and are left as they are."""
        pairs = list(grads_and_vars)
        own = self.model_params()
        own_ids = {id(p) for p in own}
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise TypeError(f"{where}[{i}] must be a (grad, param) pair, got {pair!r}")
            g, p = pair
            if id(p) not in own_ids:
                raise ValueError(
                    f"{where}[{i}] names a tensor of shape {tuple(p.shape)} that this "
                    "optimizer does not hold; build the inner optimizer over it first"
                )
            if g is not None and g.shape != p.shape:
                raise ValueError(
                    f"{where}[{i}]: gradient shape {tuple(g.shape)} does not match "
                    f"parameter shape {tuple(p.shape)}"
                )
        missing = [f"{where}[{i}] of shape {tuple(p.shape)}" for i, (g, p) in enumerate(pairs)
                   if g is None]  # fmt: skip
        if len(missing) == len(pairs):
            # Stepping would count an empty step and grow the scale on no evidence.
            raise ValueError(
                f"No gradients provided for any variable. ({len(pairs)} variable(s), every "
                "gradient None: the loss does not depend on them; pass the variables the "
                "loss was computed from)"
            )
        if missing:
            warnings.warn(
                f"Gradients do not exist for variables [{', '.join(missing)}] when minimizing "
                "the loss; they are left as they are",
                UserWarning,
                stacklevel=3,
            )
        saved = {id(p): p.grad for p in own}
        for p in own:
            p.grad = None
        for g, p in pairs:
            # A private copy: the step unscales in place, and g may be shared or expanded.
            p.grad = None if g is None else g.detach().to(p.dtype, copy=True).contiguous()
        try:
            if scaled:  # gradients of a scaled loss, handed over by the caller
                self.loss_scaler.mark_scaled()
            else:  # already unscaled: checked, not divided again
                self.check_unscaled_()
            self.step()
        finally:
            for p in own:
                p.grad = saved[id(p)]

    def minimize(
        self,
        loss: torch.Tensor | Callable[[], torch.Tensor],
        var_list: Iterable[torch.Tensor] | torch.Tensor,
    ) -> torch.Tensor:
        """Scale, differentiate, unscale, apply and update in one call; returns the loss.

        A non-scalar loss is differentiated as its sum (TensorFlow's ``tape.gradient``);
        variables it does not depend on are warned about and left alone, and none at all
        is a ``ValueError`` (:meth:`apply_gradients`)."""
        var_list = [var_list] if isinstance(var_list, torch.Tensor) else list(var_list)
        with torch.enable_grad():
            value = _loss_value(loss)
            scaled_grads = (
                _gradients(self.scale_loss(value), var_list)
                if value.requires_grad
                else [None] * len(var_list)  # a constant: the ValueError of _apply_pairs
            )
        # The step unscales the scaled gradients in float32 (into the masters under master
        # weights); unscaling here, in float16, would flush small gradients to zero first.
        self._apply_pairs(list(zip(scaled_grads, var_list)), scaled=True, where="var_list")
        return value.detach()


def _loss_value(loss: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    """The loss tensor: ``loss`` itself, or what the callable returns."""
    value = loss() if callable(loss) else loss
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"loss must be a tensor or return one, got {type(value).__name__}")
    return value


def _gradients(target: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of ``target`` with respect to ``params`` (``None`` where it does not
    depend on one). A non-scalar target gives the gradients of its sum, as TensorFlow's
    ``tape.gradient`` does."""
    return list(
        torch.autograd.grad(target, params, grad_outputs=torch.ones_like(target), allow_unused=True)
    )


def _tf_keys(loss_scale: core.LossScale) -> dict[str, Any]:
    """``dynamic``/``initial_scale``/``dynamic_growth_steps`` of a loss scale TF 2 can
    describe; ``ValueError`` for one it cannot."""
    if isinstance(loss_scale, FixedLossScale) or type(loss_scale) is core.StaticLossScale:
        return {"dynamic": False, "initial_scale": float(loss_scale.loss_scale)}
    if isinstance(loss_scale, DynamicLossScale) and loss_scale.multiplier == 2.0:
        return {
            "dynamic": True,
            "initial_scale": loss_scale.initial_loss_scale,
            "dynamic_growth_steps": loss_scale.increment_period,
        }
    raise ValueError(
        f"this optimizer's loss scale, {loss_scale!r}, has no TensorFlow 2 config (TF 2 "
        "describes a fixed scale or a dynamic one with multiplier 2); save "
        "optimizer.state_dict() and rebuild it with the same loss-scale object instead"
    )


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

    ``get_config()`` has TF's keys, ``inner_optimizer`` nested as ``{"module",
    "class_name", "config"}`` (:mod:`mixprec.compat._optimizer_config`);
    ``from_config(config, custom_objects=None, params=...)`` rebuilds it over
    ``params``, or takes ``config["inner_optimizer"]`` as an optimizer object. TF 2.3's
    form (``optimizer`` and ``loss_scale`` keys) is read too.
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

    def get_gradients(
        self,
        loss: torch.Tensor | Callable[[], torch.Tensor],
        params: Iterable[torch.Tensor] | torch.Tensor,
    ) -> list[torch.Tensor]:
        """The gradients of ``loss`` with respect to ``params``, computed from the scaled
        loss and returned unscaled (TF 2's ``get_gradients``); nothing is applied.

        A non-scalar ``loss`` gives the gradients of its sum; a parameter the loss does not
        depend on is a ``ValueError``, as in TensorFlow. Pass the result to
        :meth:`apply_gradients`, which checks it and steps or skips.

        >>> var = torch.nn.Parameter(torch.tensor([2.0]))
        >>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=1.0), dynamic=False,
        ...                          initial_scale=10.0)
        >>> opt.get_gradients(var * 3.0, [var])
        [tensor([3.])]
        """
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        with torch.enable_grad():
            value = _loss_value(loss)
            scaled = self.loss_scaler.scale_loss(value, self._factor())
            grads = _gradients(scaled, params) if value.requires_grad else [None] * len(params)
        # These scaled gradients are handed back unscaled, never to a step: take the mark
        # their backward left, so a later step() on gradients of no scaled loss is still
        # refused.
        self.loss_scaler.take_scaled(self)
        for i, (g, p) in enumerate(zip(grads, params)):
            if g is None:
                raise ValueError(
                    f"params[{i}] of shape {tuple(p.shape)} has `None` for gradient: the loss "
                    "does not depend on it through differentiable ops; make sure every op "
                    "between them has a gradient, or leave it out of params"
                )
        return [g for g in self.get_unscaled_gradients(grads) if g is not None]

    @classmethod
    def _with_loss_scale(
        cls, inner_optimizer: torch.optim.Optimizer, loss_scale: core.LossScale
    ) -> LossScaleOptimizer:
        """The optimizer over a given loss-scale object (TF 2.3's ``loss_scale=`` argument)."""
        self = cls.__new__(cls)
        _CoreLossScaleOptimizer.__init__(self, inner_optimizer, loss_scale)
        return self

    def get_config(self) -> dict[str, Any]:
        """TF's keys: ``inner_optimizer``, ``dynamic``, ``initial_scale``,
        ``dynamic_growth_steps`` (hyperparameters only; the state is in ``state_dict()``)."""
        keys = _tf_keys(self.loss_scaler)
        return {
            "inner_optimizer": optimizer_config(self.inner_optimizer),
            "dynamic": keys["dynamic"],
            "initial_scale": keys["initial_scale"],
            "dynamic_growth_steps": keys.get("dynamic_growth_steps"),
        }

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        custom_objects: Mapping[str, Any] | None = None,
        *,
        params: Any = None,
    ) -> LossScaleOptimizer:
        """Rebuild from :meth:`get_config` (or TF 2.3's config) over ``params``."""
        config = dict(config)
        if "loss_scale" in config:  # TF 2.3: {"optimizer": ..., "loss_scale": ...}
            loss_scale = loss_scale_from_config(config.pop("loss_scale"))
            if isinstance(loss_scale, DynamicLossScale) and loss_scale.multiplier != 2.0:
                raise ValueError(
                    "Cannot deserialize LossScaleOptimizer with a DynamicLossScale whose "
                    f"multiplier is not 2. Got DynamicLossScale: {loss_scale!r}"
                )
            config.update(_tf_keys(loss_scale), inner_optimizer=config.pop("optimizer", None))
        if "inner_optimizer" not in config:
            raise ValueError(f"config has no 'inner_optimizer' (keys: {sorted(config)})")
        inner = inner_from_config(config.pop("inner_optimizer"), params, custom_objects)
        return cls(inner, **config)
