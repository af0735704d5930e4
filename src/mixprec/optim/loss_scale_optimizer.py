"""``LossScaleOptimizer``: wraps any ``torch.optim.Optimizer`` with loss scaling.

One ``step()``: grads -> (fp32 master grads) -> unscale + finite check -> (accumulate)
-> clip -> decoupled weight decay -> inner step (skipped on overflow) -> EMA -> (copy
masters back) -> update the loss scale -> count. Nothing there reads a value back to
the host but the ``found_inf.item()`` that skips a non-fused inner step; fused inner
optimizers take ``found_inf`` and skip on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.loss_scale import loss_scale_from_spec
from mixprec.numerics import unscale_and_check_
from mixprec.optim.accumulation import GradientAccumulator
from mixprec.optim.checkpoint import load_state, optimizer_state
from mixprec.optim.clipping import clip_gradients_, decay_
from mixprec.optim.ema import ParameterEMA
from mixprec.optim.master_weights import MasterWeights
from mixprec.optim.options import check_options
from mixprec.optim.wrapper import OptimizerWrapper, step_or_skip

__all__ = ["LossScaleOptimizer"]


class LossScaleOptimizer(OptimizerWrapper):
    """An optimizer that applies loss scaling (and mixed-precision extras) to another::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
        opt.scale_loss(loss).backward()     # loss * scale
        opt.step()                          # unscale, check, skip or apply, update scale
        opt.zero_grad()

    ``loss_scale``: ``"dynamic"`` (the default: :class:`~mixprec.DynamicLossScale`,
    starting at 2**15, doubled after 2000 finite steps, halved on overflow), a
    positive number (a fixed scale), ``None``/``"none"`` (no scaling; non-finite steps
    are still skipped) or any :class:`~mixprec.LossScale` object.

    Every step whose (unscaled) gradients hold an inf or NaN is skipped: the
    parameters, the inner optimizer's state, the EMA and the weight decay are all
    left exactly as they were, and ``iterations`` does not advance.

    Options (all act on *unscaled* gradients and only on applied steps):
        clipnorm: clip each gradient's L2 norm to this.
        clipvalue: clamp gradient elements to ``[-clipvalue, clipvalue]`` (applied first).
        global_clipnorm: clip the joint norm of all gradients (excludes ``clipnorm``).
        weight_decay: decoupled decay ``p -= lr * weight_decay * p`` before the inner step;
            stored as ``decoupled_weight_decay`` because ``opt.weight_decay`` delegates to
            the inner optimizer's own ``weight_decay`` hyperparameter.
        use_ema, ema_momentum, ema_overwrite_frequency: keep float32 moving averages of the
            parameters; :meth:`copy_ema_to_params` writes them into the model.
        loss_scale_factor: a fixed extra factor on the loss, removed from the gradients.
        gradient_accumulation_steps: parameters change every N ``step()`` calls, with the
            average of the N unscaled gradients; one overflowing micro-batch skips the
            whole window (and backs the scale off once). Call ``zero_grad()`` after every
            ``step()`` as usual.
        master_weights: the model's parameters are float16/bfloat16; the inner optimizer
            steps float32 copies and the result is copied back after each applied step.
        skip_nonfinite: ``False`` applies every step, even one with inf/NaN gradients.

    ``param_groups``, ``state`` and hyperparameters (``opt.lr``) are the inner optimizer's
    (:class:`~mixprec.optim.wrapper.OptimizerWrapper`). Counters are tensors, so reading
    them is the only sync: ``iterations`` (applied steps), ``skipped_steps``,
    ``last_step_skipped``. Host syncs per ``step()``: none for fused inner optimizers
    (``fused=True``), one otherwise.

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
        scaler = loss_scale_from_spec(loss_scale)
        accumulation = check_options(
            inner_optimizer, master_weights=master_weights, clipnorm=clipnorm,
            clipvalue=clipvalue, global_clipnorm=global_clipnorm, weight_decay=weight_decay,
            use_ema=use_ema, ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency, loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps, skip_nonfinite=skip_nonfinite,
        )  # fmt: skip

        super().__init__(inner_optimizer)
        # Straight into __dict__, not through __setattr__'s delegation: a name that is also
        # an inner hyperparameter (Adam/AdamW have their own ``decoupled_weight_decay``) would
        # otherwise be written into the inner optimizer's param groups.
        self.__dict__.update(
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

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self._inner!r}, loss_scale={self.loss_scaler!r})"

    # -- what happened ----------------------------------------------------------------

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (float32 scalar tensor)."""
        return self.loss_scaler.scale

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

        The scale used is remembered (a device-side copy) and ``step()`` unscales by it, so
        a loss scale shared with another optimizer that steps (and backs off) first stays
        correct. No host sync.
        """
        scaled = self.loss_scaler.scale_loss(loss, self._factor())
        self.__dict__["_scale_used"] = self.loss_scaler.scale.detach().clone()
        return scaled

    # -- the step ---------------------------------------------------------------------

    def _stepped_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates (masters under master weights)."""
        return [p for g in self._inner.param_groups for p in g["params"]]

    def _prepare(self, params: list[torch.Tensor], unscaled: bool = False) -> torch.Tensor | None:
        """Unscale and check this step's gradients; ``None`` if the window is not full."""
        if self._master is not None:
            self._master.grads_to_masters()
        grads = [p.grad for p in params]
        if unscaled:  # already divided by the scale: check only
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
        if not self.skip_nonfinite:
            found_inf = torch.zeros_like(found_inf)
        # 1 on an applied step, 0 on a skipped one: decay and EMA multiply by it.
        applied = 1.0 - found_inf if self.decoupled_weight_decay or self._ema else None
        with torch.no_grad():
            clip_gradients_(
                [p.grad for p in params if p.grad is not None],
                self.clipvalue,
                self.clipnorm,
                self.global_clipnorm,
            )
            if self.decoupled_weight_decay:
                decay_(self._inner.param_groups, self.decoupled_weight_decay, applied)
        step_or_skip(self._inner, found_inf, self.skip_nonfinite)
        if self._ema is not None:
            self._ema.update(params, applied, self.iterations.to(applied.device))
        if self._master is not None:
            self._master.masters_to_model()
        if self.skipped_steps.device != found_inf.device:
            self.skipped_steps = self.skipped_steps.to(found_inf.device, non_blocking=True)
        self.skipped_steps.add_(found_inf > 0)
        self._steps_taken += 1
        self._last_found_inf = found_inf

    def _step(self, unscaled: bool = False) -> None:
        """The step on the gradients in ``.grad``: still scaled, or already ``unscaled``."""
        params = self._stepped_params()
        found_inf = self._prepare(params, unscaled)
        if found_inf is None:  # inside an accumulation window: nothing changes yet
            return
        self._apply(params, found_inf)
        self.loss_scaler.update(found_inf=found_inf)

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
        if self.__dict__.get("_ema") is not None:
            self._ema = ParameterEMA(
                self._stepped_params(), self._ema.momentum, self._ema.overwrite_frequency
            )

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters (not their float32 masters), in group order."""
        return self._master.model_params if self._master else self._stepped_params()

    # -- EMA and checkpoints ------------------------------------------------------------

    def copy_ema_to_params(self) -> None:
        """Overwrite the parameters with their moving averages (needs ``use_ema=True``)."""
        if self._ema is None:
            raise ValueError("copy_ema_to_params() needs use_ema=True on this optimizer")
        self._ema.copy_into(self._stepped_params())
        if self._master is not None:
            self._master.masters_to_model()

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, loss-scale state, counters, masters, EMA, accumulation."""
        return optimizer_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; everything is checked before anything changes."""
        load_state(self, state_dict)

