"""``LossScaleOptimizer``: wraps any ``torch.optim.Optimizer`` with loss scaling.

One ``step()``: grads -> (fp32 master grads) -> unscale + finite check -> (accumulate)
-> clip -> decoupled weight decay -> inner step (skipped on overflow) -> EMA -> (copy
masters back) -> update the loss scale -> count. The only host read is the
``found_inf.item()`` of a non-fused inner step; fused ones skip on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.diagnostics.monitor import GradientMonitor
from mixprec.dtypes import low_precision_of
from mixprec.loss_scale import loss_scale_from_spec
from mixprec.numerics import unscale_and_check_
from mixprec.optim.accumulation import GradientAccumulator
from mixprec.optim.checkpoint import load_state, optimizer_state
from mixprec.optim.clipping import decay_
from mixprec.optim.counters import StepCounters
from mixprec.optim.distributed import DistributedSteps
from mixprec.optim.ema import ParameterEMA
from mixprec.optim.lean import LeanUpdates
from mixprec.optim.misuse import refuse_unscaled_gradients
from mixprec.optim.options import build_master, check_options
from mixprec.optim.wrapper import OptimizerWrapper, step_or_skip

__all__ = ["LossScaleOptimizer"]


class LossScaleOptimizer(DistributedSteps, OptimizerWrapper):
    """An optimizer that applies loss scaling (and mixed-precision extras) to another::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
        opt.scale_loss(loss).backward()     # loss * scale
        opt.step()                          # unscale, check, skip or apply, update scale
        opt.zero_grad()

    ``loss_scale``: ``"dynamic"`` (default: :class:`~mixprec.DynamicLossScale` from 2**15),
    a number (fixed), ``None`` (no scaling, overflows still skipped) or a ``LossScale``.

    Every step whose (unscaled) gradients hold an inf or NaN is skipped: parameters,
    inner state, EMA and decay stay exactly as they were; ``iterations`` does not advance.

    Options (all act on *unscaled* gradients and only on applied steps):
        clipnorm: clip each gradient's L2 norm to this.
        clipvalue: clamp gradient elements to ``[-clipvalue, clipvalue]`` (applied first).
        global_clipnorm: clip the joint norm of all gradients (excludes ``clipnorm``).
        weight_decay: decoupled ``p -= lr * weight_decay * p`` (``opt.decoupled_weight_decay``).
        use_ema, ema_momentum, ema_overwrite_frequency: float32 averages (copy_ema_to_params).
        loss_scale_factor: a fixed extra factor on the loss, removed from the gradients.
        gradient_accumulation_steps: step every N ``step()`` calls on the average gradient;
            one overflowing micro-batch skips the window (``zero_grad()`` after each).
        master_weights: True/"fp32" (float32 masters are stepped), "kahan" or "stochastic"
            (the low-precision parameters are stepped, updates kept: mixprec.optim.lean).
        skip_nonfinite: ``False`` applies every step, even one with inf/NaN gradients.
        process_group: the ranks that skip together (:mod:`mixprec.optim.distributed`).
        monitor_every: sample gradient precision every N steps, no syncs in between
            (``opt.gradient_monitor``, a :class:`~mixprec.diagnostics.GradientMonitor`).

    ``param_groups``, ``state``, ``opt.lr`` are the inner optimizer's. Counters are tensors:
    ``iterations``, ``skipped_steps``, ``last_step_skipped``. Host syncs per ``step()``:
    none for fused inner optimizers after their first step, one otherwise.

    >>> var = torch.tensor(1.0, requires_grad=True)
    >>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    >>> opt.scale_loss(var**2).backward(); opt.step()
    >>> var
    tensor(0.5000, requires_grad=True)
    >>> opt.lr, float(opt.loss_scale), int(opt.iterations)
    (0.25, 32768.0, 1)
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        loss_scale: Any = "dynamic",
        *,
        master_weights: bool | str = False,
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
        process_group: Any = None,
        monitor_every: int | None = None,
    ) -> None:
        # Validate everything before touching the inner optimizer: a rejected
        # construction must leave it exactly as it was.
        accumulation = check_options(
            inner_optimizer, master_weights=master_weights, clipnorm=clipnorm,
            clipvalue=clipvalue, global_clipnorm=global_clipnorm, weight_decay=weight_decay,
            use_ema=use_ema, ema_momentum=ema_momentum, process_group=process_group,
            monitor_every=monitor_every,
            ema_overwrite_frequency=ema_overwrite_frequency, loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps, skip_nonfinite=skip_nonfinite,
        )  # fmt: skip
        scaler = loss_scale_from_spec(loss_scale)
        super().__init__(inner_optimizer)
        # Into __dict__, not through __setattr__: a name that is also an inner hyperparameter
        # (AdamW's ``decoupled_weight_decay``) would be written into the inner param groups.
        self.__dict__.update(
            loss_scaler=scaler, clipnorm=clipnorm, clipvalue=clipvalue,
            global_clipnorm=global_clipnorm, decoupled_weight_decay=weight_decay,
            loss_scale_factor=loss_scale_factor, skip_nonfinite=skip_nonfinite,
            gradient_accumulation_steps=accumulation, process_group=process_group,
        )  # fmt: skip
        self._master = build_master(inner_optimizer, master_weights)
        self._accumulator = GradientAccumulator(accumulation) if accumulation else None
        params = self._stepped_params()
        self._ema = ParameterEMA(params, ema_momentum, ema_overwrite_frequency) if use_ema else None
        self._counters = StepCounters()  # tensors: correct under torch.compile, no syncs
        scaler.take_scaled(self)  # from now on, step() asks whether a loss was scaled
        self.gradient_monitor = None if monitor_every is None else GradientMonitor(
            self, every=monitor_every, dtype=low_precision_of(self.model_params())
        )

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self._inner!r}, loss_scale={self.loss_scaler!r})"

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (float32 scalar tensor)."""
        return self.loss_scaler.scale

    @property
    def iterations(self) -> torch.Tensor:
        """Applied (not skipped) steps, an int64 tensor; assignable (``opt.iterations = 0``)."""
        return self._counters.applied.clone()

    @iterations.setter
    def iterations(self, value: Any) -> None:
        self._counters.set_applied(value)

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped because of non-finite gradients, an int64 tensor."""
        return self._counters.skipped.clone()

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """Whether the last step was skipped, a bool tensor (reading it syncs)."""
        return self._counters.last_found_inf > 0

    @property
    def use_ema(self) -> bool:
        return self._ema is not None

    @property
    def master_weights(self) -> bool | str:  # False, True (float32), "kahan" or "stochastic"
        return getattr(self._master, "mode", True) if self._master is not None else False

    def _factor(self) -> float:
        return 1.0 if self.loss_scale_factor is None else float(self.loss_scale_factor)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale * loss_scale_factor``; call ``.backward()`` on the result.

        ``step()`` unscales by the scale used here (a device-side copy), so a loss scale
        shared with an optimizer that steps (and backs off) first stays correct. No sync.
        """
        scaled = self.loss_scaler.scale_loss(loss, self._factor())
        self.__dict__["_scale_used"] = self.loss_scaler.scale.detach().clone()
        return scaled

    def _stepped_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates (masters under master weights)."""
        return [p for g in self._inner.param_groups for p in g["params"]]

    def unscale_(self) -> torch.Tensor:
        """Divide this step's gradients by the loss scale now, in place (once per step);
        return ``found_inf`` (1.0 if any unscaled gradient is inf/NaN; no sync).

        ``GradScaler.unscale_``'s recipe: clipping then sees true gradients, and
        :meth:`step` does not unscale again::

            opt.scale_loss(loss).backward()
            opt.unscale_(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()

        Under ``master_weights=True`` the unscaled gradients are the float32 masters'
        (``opt.param_groups``): clip those, or use ``global_clipnorm=``. Once per step.
        """
        if "_unscaled_found_inf" in self.__dict__:
            raise RuntimeError(
                "unscale_() has already been called since the last step(); call it once per step"
            )
        found_inf = self.__dict__["_unscaled_found_inf"] = self._unscale(self._stepped_params(), False)
        return found_inf

    def _unscale(self, params: list[torch.Tensor], unscaled: bool) -> torch.Tensor:
        """Copy to masters, unscale (unless ``unscaled``) and check; return ``found_inf``."""
        if not unscaled and not self.loss_scaler.take_scaled(self):
            refuse_unscaled_gradients(self.loss_scaler, self._inner.param_groups)
        if self._master is not None:
            self._master.grads_to_masters()
        grads = [p.grad for p in params]
        if unscaled:  # already divided by the scale: check only
            one = torch.ones((), dtype=torch.float32, device=self.loss_scaler.device)
            return unscale_and_check_(grads, one)
        used = self.__dict__.pop("_scale_used", None)
        return self.loss_scaler.unscale_(grads, self._factor(), scale=used)

    def _prepare(self, params: list[torch.Tensor], unscaled: bool = False) -> torch.Tensor | None:
        """Unscale and check this step's gradients; ``None`` if the window is not full."""
        found_inf = self.__dict__.pop("_unscaled_found_inf", None)
        if found_inf is None:
            found_inf = self._unscale(params, unscaled)
        if self._accumulator is None:
            return self._agree(found_inf)  # all ranks' verdict, before anything is applied
        return self._agree(self._accumulator.window(params, found_inf))

    def _apply(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> bool:
        """Clip, decay, step (or skip), EMA, copy back, count; leave the scale alone.
        Returns whether the step is known on the host to have been skipped."""
        if not self.skip_nonfinite:
            found_inf = torch.zeros_like(found_inf)
        # 1 on an applied step, 0 on a skipped one: decay and EMA multiply by it.
        applied = 1.0 - found_inf if self.decoupled_weight_decay or self._ema else None
        lean = self._master if isinstance(self._master, LeanUpdates) else None
        with torch.no_grad():
            self._clip(params)  # norms across shards (mixprec.optim.distributed)
            if self.decoupled_weight_decay and lean is None:
                decay_(self._inner.param_groups, self.decoupled_weight_decay, applied)
        if lean is None:
            skipped = step_or_skip(self._inner, found_inf, self.skip_nonfinite)
        else:  # decay is folded into the lean update, where bfloat16 keeps it
            skipped = lean.step(found_inf, self.skip_nonfinite, self.decoupled_weight_decay)
        if self._ema is not None:
            self._ema.update(params, applied, self._counters.applied.to(applied.device))
        if self._master is not None:
            self._master.masters_to_model()
        self._counters.record(found_inf)
        return skipped

    def _step(self, unscaled: bool = False) -> None:
        """The step on the gradients in ``.grad``: still scaled, or already ``unscaled``."""
        params = self._stepped_params()
        found_inf = self._prepare(params, unscaled)
        if found_inf is None:  # inside an accumulation window: nothing changes yet
            return
        skipped = self._apply(params, found_inf)
        self.loss_scaler.update(found_inf=found_inf)
        self.loss_scaler.observe_step(skipped)  # may raise ScaleCollapseError

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale (unless :meth:`unscale_` did), check, clip, apply or skip, update the scale.

        ``closure``, if given, runs first (gradients enabled) and must call
        ``self.scale_loss(loss).backward()``. Gradients that no :meth:`scale_loss` produced
        raise ``RuntimeError``; a collapsed dynamic scale raises
        :class:`~mixprec.ScaleCollapseError` (checked after skipped non-fused steps; fused
        loops call ``opt.loss_scaler.raise_if_collapsed()`` where they sync anyway).
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._master is not None:
            self._master.zero_grad(set_to_none)
        self._inner.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # .get: torch's constructor calls this before the parts below exist.
        if self.__dict__.get("_master") is not None:
            param_group = self._master.add_param_group(param_group)
        super().add_param_group(param_group)
        if (ema := self.__dict__.get("_ema")) is not None:
            self._ema = ParameterEMA(self._stepped_params(), ema.momentum, ema.overwrite_frequency)

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters (not their float32 masters), in group order."""
        return self._master.model_params if self._master else self._stepped_params()

    def copy_ema_to_params(self) -> None:
        """Overwrite the parameters with their moving averages (needs ``use_ema=True``)."""
        if self._ema is None:
            raise ValueError("copy_ema_to_params() needs use_ema=True on this optimizer")
        self._ema.copy_into(self._stepped_params())
        if self._master is not None:
            self._master.masters_to_model()

    # state_dict(): the inner optimizer's plus "mixprec" (loss scale, counters, masters, EMA,
    # accumulation); loading checks everything first (mixprec.optim.checkpoint).
    def _own_state_dict(self) -> dict[str, Any]:
        return optimizer_state(self)

    def _load_own_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_state(self, state_dict)
