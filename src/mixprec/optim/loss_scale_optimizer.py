"""``LossScaleOptimizer``: wraps any ``torch.optim.Optimizer`` with loss scaling.

One ``step()`` reads top to bottom::

    grads -> (fp32 master grads) -> unscale + finite check -> (accumulate) ->
    clip -> decoupled weight decay -> inner step (skipped on overflow) ->
    EMA -> (copy masters back) -> update the loss scale -> count

Nothing in that chain reads a value back to the host, except the one
``found_inf.item()`` needed to skip the inner step of an optimizer that cannot
skip by itself. Fused inner optimizers (``Adam/AdamW/SGD(fused=True)``) receive
``found_inf`` and skip on the device: zero host syncs per step.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec.loss_scale import DynamicLossScale, LossScale, StaticLossScale
from mixprec.numerics import unscale_and_check_
from mixprec.optim.accumulation import GradientAccumulator, check_accumulation_steps
from mixprec.optim.clipping import (
    check_clip_options,
    clip_by_global_norm_,
    clip_by_norm_,
    clip_by_value_,
)
from mixprec.optim.ema import ParameterEMA
from mixprec.optim.master_weights import MasterWeights

__all__ = ["LossScaleOptimizer", "joint_step"]

_DEFAULT_INITIAL_SCALE = 2.0**15
_DEFAULT_GROWTH_STEPS = 2000


def _build_loss_scale(
    dynamic: Any, initial_scale: Any, dynamic_growth_steps: Any, loss_scale: Any
) -> LossScale:
    """The loss scale that the constructor's arguments describe (validated)."""
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be True or False, got {dynamic!r}")
    if loss_scale is not None:
        if not isinstance(loss_scale, LossScale):
            raise TypeError(
                f"loss_scale must be a mixprec.loss_scale.LossScale object, got {loss_scale!r}; "
                "for a number use dynamic=False, initial_scale=<number>"
            )
        if initial_scale is not None or dynamic_growth_steps is not None or not dynamic:
            raise ValueError(
                "loss_scale=<object> replaces dynamic/initial_scale/dynamic_growth_steps; "
                f"got also dynamic={dynamic!r}, initial_scale={initial_scale!r}, "
                f"dynamic_growth_steps={dynamic_growth_steps!r}: pass only one of the two forms"
            )
        return loss_scale
    if not dynamic:
        if initial_scale is None:
            raise ValueError(
                "dynamic=False needs initial_scale, the fixed loss scale to use "
                "(e.g. LossScaleOptimizer(opt, dynamic=False, initial_scale=128))"
            )
        if dynamic_growth_steps is not None:
            raise ValueError(
                f"dynamic_growth_steps={dynamic_growth_steps!r} can only be set when dynamic=True"
            )
        return StaticLossScale(initial_scale)
    if isinstance(initial_scale, numbers.Real) and not isinstance(initial_scale, bool):
        if initial_scale > DynamicLossScale.max_scale:
            raise ValueError(
                f"initial_scale={initial_scale!r} exceeds the dynamic scale's ceiling "
                f"{DynamicLossScale.max_scale:g}; pass loss_scale=DynamicLossScale(...) with a "
                "larger max_scale to start higher"
            )
    return DynamicLossScale(
        initial_scale=_DEFAULT_INITIAL_SCALE if initial_scale is None else initial_scale,
        growth_interval=_DEFAULT_GROWTH_STEPS
        if dynamic_growth_steps is None
        else dynamic_growth_steps,
    )


class LossScaleOptimizer(torch.optim.Optimizer):
    """An optimizer that applies loss scaling (and mixed-precision extras) to another.

    Eager PyTorch style::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
        opt.scale_loss(loss).backward()     # loss * scale
        opt.step()                          # unscale, check, skip or apply, update scale
        opt.zero_grad()

    TensorFlow style: :meth:`minimize`, :meth:`get_scaled_loss`,
    :meth:`get_unscaled_gradients`, :meth:`apply_gradients`.

    Loss scale: dynamic by default (``initial_scale=2**15``, doubled after
    ``dynamic_growth_steps=2000`` finite steps, halved on overflow);
    ``dynamic=False, initial_scale=S`` for a fixed one; or ``loss_scale=`` any
    :class:`~mixprec.loss_scale.LossScale` (``NoOpLossScale()`` for none).

    Every step whose (unscaled) gradients hold an inf or NaN is skipped: the
    parameters, the inner optimizer's state, the EMA and the weight decay are all
    left exactly as they were, and ``iterations`` does not advance.

    Options (Keras names; all act on *unscaled* gradients and only on applied steps):
        clipnorm: clip each gradient's L2 norm to this.
        clipvalue: clamp gradient elements to ``[-clipvalue, clipvalue]`` (applied first).
        global_clipnorm: clip the joint norm of all gradients (excludes ``clipnorm``).
        weight_decay: decoupled decay ``p -= lr * weight_decay * p`` before the inner step;
            stored as ``decoupled_weight_decay`` because ``opt.weight_decay`` delegates to
            the inner optimizer's own ``weight_decay`` hyperparameter.
        use_ema, ema_momentum, ema_overwrite_frequency: keep float32 moving averages of the
            parameters; :meth:`finalize_variable_values` writes them into the model.
        loss_scale_factor: a fixed extra factor on the loss, removed from the gradients.
        gradient_accumulation_steps: parameters change every N ``step()`` calls, with the
            average of the N unscaled gradients; one overflowing micro-batch skips the
            whole window (and backs the scale off once). Call ``zero_grad()`` after every
            ``step()`` as usual.
        master_weights: the model's parameters are float16/bfloat16; the inner optimizer
            steps float32 copies and the result is copied back after each applied step.

    Hyperparameters of the inner optimizer (the names in its ``defaults``, e.g. ``lr``,
    ``momentum``, ``betas``, ``eps``) read from and write to its param groups:
    ``opt.betas = (0.7, 0.999)``. PyTorch spells Keras's ``beta_1`` as ``betas[0]``. Any
    other attribute is not delegated. ``param_groups`` and ``state`` are the inner
    optimizer's, so LR schedulers and ``clip_grad_norm_`` work on the wrapper.

    Counters are tensors so that reading them is the only sync: ``iterations`` (applied
    steps), ``skipped_steps``, ``last_step_skipped``; ``loss_scale`` is the current scale.

    Host syncs in ``step()``: none for fused inner optimizers, one otherwise.

    >>> var = torch.tensor(1.0, requires_grad=True)
    >>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    >>> _ = opt.minimize(lambda: var**2, var_list=[var])
    >>> var
    tensor(0.5000, requires_grad=True)
    >>> opt.lr, float(opt.loss_scale), int(opt.iterations)
    (0.25, 32768.0, 1)
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        loss_scale: LossScale | None = None,
        *,
        master_weights: bool = False,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        skip_nonfinite: bool = True,
    ) -> None:
        # Validate everything before touching the inner optimizer: a rejected
        # construction must leave it exactly as it was.
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}"
            )
        if isinstance(inner_optimizer, LossScaleOptimizer):
            raise ValueError(
                "inner_optimizer is already a LossScaleOptimizer; wrap the plain optimizer once"
            )
        scaler = _build_loss_scale(dynamic, initial_scale, dynamic_growth_steps, loss_scale)
        check_clip_options(clipnorm, clipvalue, global_clipnorm)
        for name, value in (
            ("weight_decay", weight_decay),
            ("loss_scale_factor", loss_scale_factor),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0
            ):
                raise ValueError(f"{name} must be a non-negative number or None, got {value!r}")
        if loss_scale_factor is not None and loss_scale_factor == 0:
            raise ValueError("loss_scale_factor must be positive, got 0")
        accumulation = check_accumulation_steps(gradient_accumulation_steps)
        for name, value in (
            ("master_weights", master_weights),
            ("use_ema", use_ema),
            ("skip_nonfinite", skip_nonfinite),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if use_ema:
            ParameterEMA([], ema_momentum, ema_overwrite_frequency)  # validates only
        if master_weights:
            MasterWeights.check(inner_optimizer)

        d = self.__dict__
        d["_inner"] = inner_optimizer
        # What torch.optim.Optimizer.__init__ sets up for hooks; its param_groups and
        # state are the inner optimizer's (properties below).
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        # Straight into __dict__, not through __setattr__'s delegation: a name that is also
        # an inner hyperparameter (Adam/AdamW have their own ``decoupled_weight_decay``) would
        # otherwise be written into the inner optimizer's param groups.
        d.update(
            loss_scaler=scaler,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            decoupled_weight_decay=weight_decay,
            loss_scale_factor=loss_scale_factor,
            skip_nonfinite=skip_nonfinite,
            gradient_accumulation_steps=accumulation,
        )
        self._master = MasterWeights(inner_optimizer) if master_weights else None
        self._accumulator = GradientAccumulator(accumulation) if accumulation else None
        self._ema = (
            ParameterEMA(self._stepped_params(), ema_momentum, ema_overwrite_frequency)
            if use_ema
            else None
        )
        # Counters live on the gradients' device (moved at the first step), so that
        # counting never copies a flag to the host. Steps taken are counted on the host.
        self._steps_taken = 0
        self.skipped_steps = torch.zeros((), dtype=torch.int64)
        self._last_found_inf = torch.zeros(())

    # -- delegation -------------------------------------------------------------------

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.defaults

    def _is_hyperparameter(self, name: str) -> bool:
        inner = self.__dict__.get("_inner")
        return inner is not None and name != "params" and name in inner.defaults

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: delegate inner hyperparameters.
        if self._is_hyperparameter(name):
            return self._inner.param_groups[0][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            self._is_hyperparameter(name)
            and name not in self.__dict__
            and not hasattr(type(self), name)
        ):
            for group in self._inner.param_groups:
                group[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._patch_step_function()

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self._inner!r}, loss_scale={self.loss_scaler!r})"

    # -- TF/Keras attributes ----------------------------------------------------------

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (float32 scalar tensor)."""
        return self.loss_scaler.scale

    @property
    def dynamic(self) -> bool:
        return isinstance(self.loss_scaler, DynamicLossScale)

    @property
    def initial_scale(self) -> float:
        ls = self.loss_scaler
        if isinstance(ls, DynamicLossScale):
            return float(ls.initial_scale)
        if isinstance(ls, StaticLossScale):
            return float(ls.loss_scale)
        return 1.0

    @property
    def dynamic_growth_steps(self) -> int | None:
        return self.loss_scaler.growth_interval if self.dynamic else None

    @property
    def dynamic_counter(self) -> torch.Tensor | None:
        """Finite steps since the scale last changed (``None`` unless dynamic)."""
        return self.loss_scaler.counter if self.dynamic else None

    @property
    def iterations(self) -> torch.Tensor:
        """Applied (not skipped) optimizer steps, an int64 tensor (reading it syncs)."""
        return self._steps_taken - self.skipped_steps

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """Whether the last step was skipped, a bool tensor (reading it syncs)."""
        return self._last_found_inf > 0

    @property
    def use_ema(self) -> bool:
        return self._ema is not None

    @property
    def master_weights(self) -> bool:
        return self._master is not None

    # -- scaling ----------------------------------------------------------------------

    def _factor(self) -> float:
        return 1.0 if self.loss_scale_factor is None else float(self.loss_scale_factor)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale * loss_scale_factor``; call ``.backward()`` on the result.

        May be used for several backward passes before one ``step()``. The scale used is
        remembered (a device-side copy) and ``step()`` unscales by it, so a loss scale
        shared with another optimizer that steps (and backs off) first stays correct.
        """
        scaled = self.loss_scaler.scale_loss(loss, self._factor())
        self.__dict__["_scale_used"] = self.loss_scaler.scale.detach().clone()
        return scaled

    def get_scaled_loss(self, loss: torch.Tensor | Callable[[], torch.Tensor]) -> Any:
        """TF spelling of :meth:`scale_loss`; a callable gives a callable back."""
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

    # -- the step ---------------------------------------------------------------------

    def _stepped_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates (masters under master weights)."""
        return [p for g in self._inner.param_groups for p in g["params"]]

    def _prepare(self, params: list[torch.Tensor], unscaled: bool = False) -> torch.Tensor | None:
        """Unscale and check this step's gradients; ``None`` if the window is not full."""
        if self._master is not None:
            self._master.grads_to_masters()
        grads = [p.grad for p in params]
        if unscaled:
            # Already divided by the scale (apply_gradients): check only.
            one = torch.ones((), dtype=torch.float32, device=self.loss_scaler.device)
            found_inf = unscale_and_check_(grads, one)
        else:
            used = self.__dict__.pop("_scale_used", None)
            found_inf = self.loss_scaler.unscale_(grads, self._factor(), scale=used)
        if self._accumulator is None:
            return found_inf
        if not self._accumulator.add(grads, found_inf):
            return None
        averages, found_inf = self._accumulator.pop_average()
        for p, avg in zip(params, averages):
            p.grad = None if avg is None else avg.to(p.dtype)
        return found_inf

    def _apply(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Clip, decay, step (or skip), EMA, copy back, count. Leaves the scale alone."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.skip_nonfinite:
            found_inf = torch.zeros_like(found_inf)
        # 1 on an applied step, 0 on a skipped one: decay and EMA multiply by it.
        applied = 1.0 - found_inf if self.decoupled_weight_decay or self._ema else None
        with torch.no_grad():
            if self.clipvalue is not None:
                clip_by_value_(grads, self.clipvalue)
            if self.clipnorm is not None:
                clip_by_norm_(grads, self.clipnorm)
            if self.global_clipnorm is not None:
                clip_by_global_norm_(grads, self.global_clipnorm)
            if self.decoupled_weight_decay:
                self._decay(applied)
        self._inner_step(found_inf, may_skip=self.skip_nonfinite)
        if self._ema is not None:
            self._ema.update(params, applied, self.iterations.to(applied.device))
        if self._master is not None:
            self._master.masters_to_model()
        if self.skipped_steps.device != found_inf.device:
            self.skipped_steps = self.skipped_steps.to(found_inf.device, non_blocking=True)
        self.skipped_steps.add_(found_inf > 0)
        self._steps_taken += 1
        self._last_found_inf = found_inf

    def _decay(self, applied: torch.Tensor) -> None:
        for group in self._inner.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                factor = 1.0 - group["lr"] * self.decoupled_weight_decay * applied
                for p in params:
                    p.mul_(factor.to(p.device, p.dtype))

    def _inner_step(self, found_inf: torch.Tensor, may_skip: bool = True) -> None:
        inner = self._inner
        if getattr(inner, "_step_supports_amp_scaling", False):
            # Fused kernels take the flag and skip on the device: no host sync.
            inner.found_inf = found_inf
            inner.grad_scale = None
            try:
                inner.step()
            finally:
                del inner.found_inf
                del inner.grad_scale
        elif not may_skip or not found_inf.item():  # the one host sync of a non-fused step
            inner.step()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale, check, clip, apply or skip, and update the loss scale.

        ``closure``, if given, is evaluated first (with gradients enabled); it must
        compute the loss and call ``self.scale_loss(loss).backward()`` itself.
        Syncs with the device only for a non-fused inner optimizer (one ``.item()``).
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        params = self._stepped_params()
        found_inf = self._prepare(params)
        if found_inf is None:  # inside an accumulation window: nothing changes yet
            return result
        self._apply(params, found_inf)
        self.loss_scaler.advance(found_inf)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._master is not None:
            self._master.zero_grad(set_to_none)
        self._inner.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._master is not None:
            param_group = self._master.add_param_group(param_group)
        self._inner.add_param_group(param_group)
        if self._ema is not None:
            self._ema = ParameterEMA(
                self._stepped_params(), self._ema.momentum, self._ema.overwrite_frequency
            )

    # -- TF style ---------------------------------------------------------------------

    def _own_params(self) -> list[torch.Tensor]:
        return self._master.model_params if self._master else self._stepped_params()

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]
    ) -> None:
        """Apply already-unscaled gradients to their parameters (TF's ``apply_gradients``).

        Only the listed parameters are updated. The step is skipped if any gradient is
        non-finite, and the loss scale is updated either way.
        """
        self._apply_pairs(grads_and_vars, scaled=False)

    def _apply_pairs(
        self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]], scaled: bool
    ) -> None:
        """Step with the given gradients: still scaled (``minimize``) or already unscaled."""
        pairs = list(grads_and_vars)
        own = self._own_params()
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
            p.grad = None if g is None else g.detach().to(p.dtype)
        try:
            params = self._stepped_params()
            found_inf = self._prepare(params, unscaled=not scaled)
            if found_inf is not None:
                self._apply(params, found_inf)
                self.loss_scaler.advance(found_inf)
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
        # Hand the scaled gradients to the step, which unscales them in float32 (into the
        # masters under master weights); unscaling here, in the gradients' float16, would
        # flush small gradients to zero before they reach the masters.
        self._apply_pairs(list(zip(scaled_grads, var_list)), scaled=True)
        return value.detach()

    # -- EMA --------------------------------------------------------------------------

    def finalize_variable_values(self) -> None:
        """Overwrite the parameters with their moving averages (needs ``use_ema=True``)."""
        if self._ema is None:
            raise ValueError("finalize_variable_values() needs use_ema=True on this optimizer")
        self._ema.copy_into(self._stepped_params())
        if self._master is not None:
            self._master.masters_to_model()

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, loss-scale state, counters, masters, EMA, accumulation."""
        return {
            "inner": self._inner.state_dict(),
            "loss_scale": {
                "kind": type(self.loss_scaler).__name__,
                "config": self.loss_scaler.get_config(),
                "state": self.loss_scaler.state_dict(),
            },
            "counters": {
                "iterations": self.iterations.clone(),
                "skipped_steps": self.skipped_steps.clone(),
                "last_step_skipped": self.last_step_skipped.clone(),
            },
            "master": None if self._master is None else self._master.state_dict(),
            "ema": None if self._ema is None else self._ema.state_dict(),
            "accumulation": None if self._accumulator is None else self._accumulator.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; everything is checked before anything changes."""
        expected = {"inner", "loss_scale", "counters", "master", "ema", "accumulation"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a LossScaleOptimizer state dict: expected keys {sorted(expected)}, got {got}"
            )
        kind = state_dict["loss_scale"]["kind"]
        if kind != type(self.loss_scaler).__name__:
            raise ValueError(
                f"the checkpoint's loss scale is a {kind}, this optimizer's is a "
                f"{type(self.loss_scaler).__name__}; build the optimizer the same way"
            )
        for name, part in (
            ("master", self._master),
            ("ema", self._ema),
            ("accumulation", self._accumulator),
        ):
            if (state_dict[name] is None) != (part is None):
                raise ValueError(
                    f"the checkpoint was saved {'without' if state_dict[name] is None else 'with'} "
                    f"{name} but this optimizer is configured {'with' if part else 'without'} it"
                )
        self._inner.load_state_dict(state_dict["inner"])
        self.loss_scaler.load_state_dict(state_dict["loss_scale"]["state"])
        counters = state_dict["counters"]
        self.skipped_steps = counters["skipped_steps"].clone().to(self.skipped_steps.device)
        self._steps_taken = int(counters["iterations"] + counters["skipped_steps"])
        self._last_found_inf = counters["last_step_skipped"].float()
        if self._master is not None:
            self._master.load_state_dict(state_dict["master"])
        if self._ema is not None:
            self._ema.load_state_dict(state_dict["ema"])
        if self._accumulator is not None:
            self._accumulator.load_state_dict(state_dict["accumulation"])


def joint_step(*optimizers: LossScaleOptimizer) -> None:
    """Step several optimizers that share one loss scale as one: skip all or none.

    The alternative to calling each ``opt.step()`` (where each optimizer skips only its
    own overflowing step, and each step advances the shared scale). Here every
    optimizer's gradients are unscaled and checked first; if any overflowed, all
    steps are skipped; then the shared scale is updated once.
    """
    if not optimizers or not all(isinstance(o, LossScaleOptimizer) for o in optimizers):
        raise TypeError("joint_step takes one or more LossScaleOptimizer objects")
    scalers = {id(o.loss_scaler) for o in optimizers}
    if len(scalers) != 1:
        raise ValueError(
            "joint_step needs optimizers that share one loss scale "
            "(build them with loss_scale=<the same LossScale object>)"
        )
    if any(o.gradient_accumulation_steps for o in optimizers):
        raise ValueError("joint_step does not combine with gradient_accumulation_steps")
    params = [o._stepped_params() for o in optimizers]
    flags = [o._prepare(p) for o, p in zip(optimizers, params)]
    found_inf = torch.stack([f.to(flags[0].device) for f in flags]).amax()
    for o, p in zip(optimizers, params):
        o._apply(p, found_inf)
    optimizers[0].loss_scaler.advance(found_inf)
