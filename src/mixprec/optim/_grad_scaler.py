"""``GradScaler``: a drop-in for ``torch.amp.GradScaler`` over mixprec's loss scales.

Same constructor, methods and state dict as torch's, so existing code switches with
one import (a fused optimizer skips overflowing steps on the device, so there a
:class:`~mixprec.ScaleCollapseError` needs ``scaler.loss_scale.raise_if_collapsed()``
where the loop syncs anyway)::

    scaler = mixprec.optim.GradScaler("cuda")      # was torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                            # optional: clip true gradients
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)                                # skipped if any gradient is inf/NaN
    scaler.update()

With the default arguments its scale sequence and parameters are torch's, bit for
bit. What it adds: ``min_scale``/``max_scale``/``hysteresis`` (or any
:class:`~mixprec.DynamicLossScale`), a :class:`~mixprec.ScaleCollapseError` when
the scale collapses (``collapse_after``), a ``RuntimeError`` for ``step()`` on
gradients that no scaled loss produced, float16 gradients unscaled in place
(torch refuses them), and a first step of a fused optimizer that cannot leave
uninitialised state behind when it overflows.

>>> w = torch.nn.Parameter(torch.ones(2))
>>> opt = torch.optim.SGD([w], lr=0.5)
>>> scaler = GradScaler("cpu", init_scale=8.0)
>>> scaler.scale((w * 2).sum()).backward()
>>> w.grad
tensor([16., 16.])
>>> scaler.step(opt); scaler.update()
>>> w, scaler.get_scale()
(Parameter containing:
tensor([0., 0.], requires_grad=True), 8.0)
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

import torch

from mixprec._checks import check_bool, check_number
from mixprec.loss_scale import (
    DynamicLossScale,
    agree_on_found_inf,
    check_process_group,
    loss_scale_state,
    restore_loss_scale,
    step_or_skip,
)
from mixprec.numerics import coalesce_sparse_half_grads_, unscale_and_check_

#: What a ``torch.amp.GradScaler`` state dict holds besides ``_growth_tracker``.
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval")


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf": None}


def _refuse_scaler_argument(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``TypeError`` for a fused optimizer whose ``step`` takes ``grad_scaler``.

    That is torch's deprecated protocol: the optimizer unscales and checks the gradients
    itself through ``torch.amp.GradScaler``'s private methods. Stepped here it would get
    ``grad_scaler=None`` and apply the scaled, unchecked gradients without a word.
    """
    try:
        parameters = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # a builtin without a signature takes no grad_scaler
        return
    if "grad_scaler" in parameters:
        raise TypeError(
            f"{type(optimizer).__name__}.step takes a grad_scaler argument (torch's deprecated "
            "protocol, which reads torch.amp.GradScaler's private state); mixprec.GradScaler "
            "does not pass one. Make step read self.grad_scale and self.found_inf, which "
            "GradScaler.step sets for an optimizer with _step_supports_amp_scaling, or use "
            "torch.amp.GradScaler with this optimizer"
        )


class GradScaler:
    """``torch.amp.GradScaler``'s interface over a :class:`~mixprec.DynamicLossScale`.

    Args (torch's): ``device``, ``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``enabled``. mixprec's, keyword-only: ``min_scale``,
    ``max_scale``, ``hysteresis``, ``collapse_after`` (see
    :class:`~mixprec.DynamicLossScale`; the defaults reproduce torch's rule), or a
    ready ``loss_scale`` object instead of all of these; ``process_group``: the ranks
    whose overflow flags are all-reduced before ``step()`` decides, so that all of them
    skip together and keep one scale (default: all ranks once ``torch.distributed`` is
    initialised; ``"local"``: no all-reduce; see :func:`mixprec.loss_scale.agree_on_found_inf`).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        collapse_after: int | None = 100,
        loss_scale: DynamicLossScale | None = None,
        process_group: Any = None,
    ) -> None:
        check_bool("enabled", enabled)
        check_process_group(process_group)
        if not isinstance(device, str | torch.device):
            raise TypeError(f"device must be a string or torch.device, got {device!r}")
        self._device = torch.device(device).type
        if loss_scale is None:
            loss_scale = DynamicLossScale(
                initial_scale=init_scale, growth_interval=growth_interval,
                growth_factor=growth_factor, backoff_factor=backoff_factor,
                min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis,
                collapse_after=collapse_after,
            )  # fmt: skip
        elif not isinstance(loss_scale, DynamicLossScale):
            raise TypeError(
                f"loss_scale must be a mixprec.DynamicLossScale, got {type(loss_scale).__name__}"
            )
        if enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "GradScaler is enabled, but CUDA is not available. Disabling.", stacklevel=2
            )
            enabled = False
        self._enabled = enabled
        self.loss_scale = loss_scale
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        self._placed = False
        self._skipped_on_host = False
        self.process_group = process_group
        loss_scale.take_scaled(self)  # from now on, steps ask whether a loss was scaled

    # -- scaling ----------------------------------------------------------------------

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if not self._placed:  # the state follows the first scaled output, as torch's does
            self.loss_scale.to(device)
            self._placed = True
        scale = self.loss_scale.scale
        return scale if scale.device == device else scale.to(device, non_blocking=True)

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor, or nested lists/tuples/iterables of them) by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self.loss_scale.mark_on_backward(outputs * self._scale_on(outputs.device))
        if isinstance(outputs, Iterable):
            scaled = map(self.scale, outputs)
            return type(outputs)(scaled) if isinstance(outputs, list | tuple) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _state_of(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if hasattr(optimizer, "loss_scaler"):
            raise TypeError(
                "GradScaler got a LossScaleOptimizer, which scales its own loss; pass its "
                "inner optimizer, or use the LossScaleOptimizer alone"
            )
        return self._per_optimizer.setdefault(id(optimizer), _fresh_state())

    def _check_scaled(self) -> None:
        if not self._placed or not self.loss_scale.take_scaled(self):
            raise RuntimeError(
                "GradScaler: no loss was scaled since the last update(); gradients from "
                "loss.backward() would be divided by the scale. Call "
                "scaler.scale(loss).backward()"
            )
        self.loss_scale.mark_scaled()  # other optimizers of this iteration share the loss

    def _grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        coalesce_sparse_half_grads_(params)
        return [p.grad for p in params if p.grad is not None]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place (once per ``update()``)."""
        if not self._enabled:
            return
        state = self._state_of(optimizer)
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._check_scaled()
        inv_scale = self.loss_scale.inv_scale()
        state["found_inf"] = unscale_and_check_(self._grads(optimizer), inv_scale)
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold an inf/NaN (unscaling first if needed).

        Returns what ``optimizer.step`` returned, or ``None`` when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._state_of(optimizer)
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused:
            _refuse_scaler_argument(optimizer)
        # A grad_scale the caller set on a fused optimizer is part of this one step, as in
        # torch's: it multiplies ours while the gradients are still scaled, it is all the
        # kernel divides by once they were unscaled, and the step consumes it.
        preset = getattr(optimizer, "grad_scale", None) if fused else None
        if fused and state["stage"] is _Stage.READY:
            # torch's fused path: check without unscaling; the kernel unscales by grad_scale.
            self._check_inf_per_device(optimizer)
            scale = self.loss_scale.scale
            grad_scale = scale if preset is None else scale * preset
        else:
            if state["stage"] is _Stage.READY:
                self.unscale_(optimizer)
            grad_scale = preset
        state["stage"] = _Stage.STEPPED
        # Every rank's verdict before this one decides: all skip together, or none does.
        found_inf = agree_on_found_inf(state["found_inf"], self.process_group)
        try:
            result, skipped = step_or_skip(
                optimizer, found_inf, grad_scale=grad_scale, args=args, kwargs=kwargs
            )
        finally:
            if preset is not None and hasattr(optimizer, "grad_scale"):
                delattr(optimizer, "grad_scale")  # also when the step was skipped on the host
        self._skipped_on_host = self._skipped_on_host or skipped
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the scale by this iteration's overflow flags, or set it to ``new_scale``
        (a finite number > 0, as a float or a one-element tensor; a tensor's value is read
        to check it, one sync)."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError(
                        "new_scale must be a float or a one-element tensor with "
                        f"requires_grad=False, got {new_scale!r}"
                    )
                # As the float form: a NaN, zero or negative scale would poison every later
                # loss. Reading the value syncs, once, on this rare call.
                number = float(new_scale)
                if not (math.isfinite(number) and number > 0):
                    raise ValueError(
                        f"new_scale must be a finite number > 0, got {number} (a tensor "
                        "holding it); pass e.g. torch.tensor(2.0**16)"
                    )
                value: Any = new_scale.detach().reshape(()).to(self.loss_scale.scale)
            else:
                check_number("new_scale", new_scale, minimum=0, exclusive=True)
                value = float(new_scale)
            self.loss_scale.scale.copy_(torch.as_tensor(value))
        else:
            flags = [
                s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None
            ]
            if not flags:
                raise RuntimeError(
                    "No inf checks were recorded prior to update(): call step() (or "
                    "unscale_()) on an optimizer first"
                )
            device = self.loss_scale.device
            found_inf = torch.stack([f.to(device, non_blocking=True) for f in flags]).amax()
            if any(s["stage"] is _Stage.UNSCALED for s in self._per_optimizer.values()):
                found_inf = agree_on_found_inf(found_inf, self.process_group)  # not stepped
            self.loss_scale.update(found_inf)
        skipped, self._skipped_on_host = self._skipped_on_host, False
        self._per_optimizer = {}  # reset first: a collapse error leaves a usable scaler
        self.loss_scale.take_scaled(self)  # the next iteration needs a scaled loss again
        if new_scale is None:
            self.loss_scale.observe_step(skipped)  # may raise ScaleCollapseError

    # -- torch's accessors ------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        return float(self.loss_scale.scale) if self._enabled else 1.0

    def _get_scale_async(self) -> torch.Tensor | None:
        return self.loss_scale.scale if self._enabled else None

    @property
    def _scale(self) -> torch.Tensor | None:
        """torch's private scale tensor, read by code that logs the scale without a host
        sync: the live scale once a loss was scaled (None before, and when disabled, as
        torch's). Read-only: set the scale with ``update(new_scale)``."""
        return self.loss_scale.scale if self._enabled and self._placed else None

    def _lazy_init_scale_growth_tracker(self, dev: str | torch.device) -> None:
        """Put the scale on ``dev`` before any loss is scaled, as torch's private method of
        this name does; Accelerate calls it after loading a scaler's state (FSDP2)."""
        self.loss_scale.to(torch.device(dev))
        self._placed = True

    def _found_inf_per_device(
        self, optimizer: torch.optim.Optimizer
    ) -> dict[torch.device, torch.Tensor]:
        """``{device: flag}``: the overflow flag ``step(optimizer)`` goes by, as torch's
        private method of this name returns it (empty before ``unscale_()``/``step()``, after
        ``update()`` and when disabled). The flag is the live one: code that all-reduces it
        across data-parallel ranks between ``unscale_()`` and ``step()`` makes every rank
        skip together, as with torch's; after ``step()`` it says whether the step was
        skipped (1.0) or applied (0.0)."""
        if not self._enabled:
            return {}
        found_inf = self._state_of(optimizer)["found_inf"]
        return {} if found_inf is None else {found_inf.device: found_inf}

    def _check_inf_per_device(
        self, optimizer: torch.optim.Optimizer
    ) -> dict[torch.device, torch.Tensor]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them and return
        :meth:`_found_inf_per_device`, as torch's private method of this name does (custom
        fused optimizers and overflow monitors call it); the gradients stay scaled."""
        if not self._enabled:
            raise RuntimeError("_check_inf_per_device(): this GradScaler is disabled")
        state = self._state_of(optimizer)
        self._check_scaled()
        one = torch.ones((), dtype=torch.float32, device=self.loss_scale.device)
        state["found_inf"] = unscale_and_check_(self._grads(optimizer), one)
        return self._found_inf_per_device(optimizer)

    def _set(self, name: str, arg: str, value: Any) -> None:
        # Validated as a whole configuration, so a setter never stores what the
        # constructor (or a later load_state_dict) would refuse.
        try:
            checked = DynamicLossScale.from_config({**self.loss_scale.get_config(), name: value})
        except (TypeError, ValueError) as err:
            raise type(err)(f"{arg}={value!r} is refused: {err}") from None
        setattr(self.loss_scale, name, getattr(checked, name))

    def get_growth_factor(self) -> float:
        return self.loss_scale.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._set("growth_factor", "new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self.loss_scale.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._set("backoff_factor", "new_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self.loss_scale.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._set("growth_interval", "new_interval", new_interval)

    def get_init_scale(self) -> float:
        return self.loss_scale.initial_scale

    def set_init_scale(self, new_scale: float) -> None:
        self._set("initial_scale", "new_scale", new_scale)

    def is_enabled(self) -> bool:
        return self._enabled

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus ``"mixprec"``: the loss scale's
        full configuration and state. Empty when disabled, as torch's."""
        if not self._enabled:
            return {}
        ls = self.loss_scale
        return {
            "scale": self.get_scale(),
            "growth_factor": ls.growth_factor,
            "backoff_factor": ls.backoff_factor,
            "growth_interval": ls.growth_interval,
            "_growth_tracker": int(ls.counter),
            "mixprec": loss_scale_state(ls),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, or a ``torch.amp.GradScaler``'s.

        A disabled scaler ignores it, as torch's does (``GradScaler(enabled=use_amp)``
        resumes whatever ``use_amp`` is)."""
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be the dict GradScaler.state_dict() returns, got "
                f"{type(state_dict).__name__}"
            )
        if len(state_dict) == 0:
            # torch's scaler raises RuntimeError here, and resume code in the wild tests
            # the message for "source state dict is empty" to skip such a checkpoint.
            raise RuntimeError(
                "The source state dict is empty: a GradScaler built with enabled=False "
                "saves {}; load it into a disabled scaler, or leave this one as built"
            )
        ls = self.loss_scale
        own = state_dict.get("mixprec")
        if own is not None:
            restore_loss_scale(ls, own)  # checks everything first
            return
        missing = [key for key in _TORCH_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"state_dict lacks {', '.join(map(repr, missing))}: it is not the state of "
                f"a GradScaler (mixprec's or torch.amp's); it has {sorted(map(str, state_dict))}"
            )
        DynamicLossScale(
            initial_scale=state_dict["scale"], growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"], min_scale=None, max_scale=None,
        )  # fmt: skip  # validates torch's numbers before anything changes
        ls.scale.fill_(state_dict["scale"])
        ls.growth_factor = float(state_dict["growth_factor"])
        ls.backoff_factor = float(state_dict["backoff_factor"])
        ls.growth_interval = int(state_dict["growth_interval"])
        if "_growth_tracker" in state_dict:
            ls.counter.fill_(int(state_dict["_growth_tracker"]))
