"""Loss scales: small state machines that keep float16 gradients out of underflow.

Three kinds share one interface, so a trainer never branches on the concrete type:

* :class:`NoOpLossScale` - scale 1, never changes (bfloat16 or float32 training).
* :class:`StaticLossScale` - a fixed scale chosen by the user.
* :class:`DynamicLossScale` - backs off on overflow, grows after a run of finite steps.

Each loss scale keeps its hyperparameters as plain dataclass fields
(``get_config()`` / ``from_config()`` round-trip them) and its state as tensors on
the gradients' device (``state_dict()`` / ``load_state_dict()`` round-trip them).
Both lists are derived from the dataclass fields, so no field can be forgotten.
Updates are branch-free tensor arithmetic: no call here syncs with the device.

>>> import torch
>>> ls = DynamicLossScale(initial_scale=2.0**15, growth_interval=2)
>>> w = torch.ones(2, requires_grad=True)
>>> ls.scale_loss((w * 3).sum()).backward()
>>> found_inf = ls.unscale_([w.grad])
>>> w.grad, found_inf
(tensor([3., 3.]), tensor(0.))
>>> ls.update(found_inf); ls.update(found_inf)   # two finite steps: scale doubles
>>> ls.scale
tensor(65536.)
>>> ls.update(torch.tensor(1.0))                  # an overflow: scale halves
>>> ls.scale
tensor(32768.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from mixprec._checks import check_number
from mixprec.numerics import unscale_and_check_

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "loss_scale_from_spec",
]


def _state_field(dtype: torch.dtype) -> Any:
    """A dataclass field holding a state tensor (not a constructor argument)."""
    return dataclasses.field(init=False, repr=False, compare=False, metadata={"state": dtype})


def _positive(name: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> None:
    check_number(name, value, integer=integer, minimum=0, exclusive=True, allow_none=allow_none)


@dataclasses.dataclass(eq=False)
class LossScale:
    """The interface every loss scale implements.

    Lifecycle of one training step::

        scaled = loss_scale.scale_loss(loss)       # loss * scale
        scaled.backward()                          # gradients are scaled too
        found_inf = loss_scale.unscale_(grads)     # grads /= scale; 1.0 if any inf/nan
        if not found_inf: apply the update         # the optimizer decides, ideally on device
        loss_scale.update(found_inf)               # adjust the scale (dynamic only)

    ``scale`` is a float32 scalar tensor that follows the gradients' device: the
    first ``scale_loss``/``unscale_`` on another device moves all state there.
    """

    scale: torch.Tensor = _state_field(torch.float32)

    #: Short name used by :func:`loss_scale_from_spec` and in configs.
    kind: ClassVar[str] = "base"

    def __post_init__(self) -> None:
        self._validate()
        self._init_state(torch.device("cpu"))

    # -- hyperparameters and state ----------------------------------------------------

    def _validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for bad hyperparameters."""

    def _initial_state(self) -> dict[str, float]:
        return {"scale": 1.0}

    def _init_state(self, device: torch.device) -> None:
        initial = self._initial_state()
        for f in self._state_fields():
            value = torch.tensor(initial.get(f.name, 0), dtype=f.metadata["state"], device=device)
            object.__setattr__(self, f.name, value)

    @classmethod
    def _state_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "state" in f.metadata]

    @classmethod
    def _config_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    def get_config(self) -> dict[str, Any]:
        """Hyperparameters as a plain dict; ``type(self).from_config(cfg)`` rebuilds it."""
        return {f.name: getattr(self, f.name) for f in self._config_fields()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LossScale:
        """Build a loss scale from :meth:`get_config`'s output (fresh state)."""
        known = {f.name for f in cls._config_fields()}
        unknown = set(config) - known
        if unknown:
            raise ValueError(
                f"config has keys {sorted(unknown)} that {cls.__name__} does not take; "
                f"accepted keys: {sorted(known)}"
            )
        return cls(**config)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state tensors (copies), for checkpoints."""
        return {f.name: getattr(self, f.name).detach().clone() for f in self._state_fields()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore state saved by :meth:`state_dict`; checks everything before changing anything."""
        expected = {f.name for f in self._state_fields()}
        if set(state_dict) != expected:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects keys {sorted(expected)}, "
                f"got {sorted(state_dict)}; was the state saved from another kind of loss scale?"
            )
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"state {name!r} must be a one-element tensor, got {value!r}")
        for name, value in state_dict.items():
            getattr(self, name).copy_(value.reshape(()))

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def to(self, device: torch.device | str) -> LossScale:
        """Move the state tensors to ``device`` (in place); returns ``self``."""
        device = torch.device(device)
        for f in self._state_fields():
            object.__setattr__(self, f.name, getattr(self, f.name).to(device, non_blocking=True))
        return self

    def _follow(self, device: torch.device) -> None:
        # State lives where the gradients live; moving is a one-time cost.
        if device != self.scale.device:
            self.to(device)

    # -- the step ---------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor, extra_factor: float = 1.0) -> torch.Tensor:
        """Return ``loss * scale * extra_factor`` (no host sync)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        self._follow(loss.device)
        scale = self.scale if extra_factor == 1.0 else self.scale * extra_factor
        return loss * scale

    def inv_scale(
        self, extra_factor: float = 1.0, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``1 / (scale * extra_factor)`` as float32, computed in float64 like GradScaler.

        ``scale`` defaults to the current one; pass the scale a loss was multiplied by
        if the state may have moved since (a loss scale shared by several optimizers).
        """
        scale = self.scale if scale is None else scale
        return (scale.double() * extra_factor).reciprocal().float()

    def unscale_(
        self,
        grads: Iterable[torch.Tensor | None],
        extra_factor: float = 1.0,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Divide ``grads`` in place by the scale; return ``found_inf`` (1.0 if any inf/NaN).

        ``None`` entries are skipped. One fused kernel per (device, dtype). No host sync.
        ``scale`` as in :meth:`inv_scale`.
        """
        grads = [g for g in grads if g is not None]
        if grads:
            self._follow(grads[0].device)
        return unscale_and_check_(grads, self.inv_scale(extra_factor, scale))

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state machine by one step (no-op for fixed scales)."""

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({config})"


@dataclasses.dataclass(eq=False, repr=False)
class NoOpLossScale(LossScale):
    """A loss scale of 1 that never changes: for bfloat16 or float32 training.

    ``unscale_`` still reports non-finite gradients, so an optimizer can skip them.

    >>> NoOpLossScale().scale
    tensor(1.)
    """

    kind: ClassVar[str] = "none"


@dataclasses.dataclass(eq=False, repr=False)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    >>> StaticLossScale(1024.0).scale
    tensor(1024.)
    """

    loss_scale: float = 2.0**15
    kind: ClassVar[str] = "static"

    def _validate(self) -> None:
        _positive("loss_scale", self.loss_scale)

    def _initial_state(self) -> dict[str, float]:
        return {"scale": float(self.loss_scale)}


@dataclasses.dataclass(eq=False, repr=False)
class DynamicLossScale(LossScale):
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    The rule, applied by :meth:`update` once per optimizer step::

        if found_inf:                        # the step is skipped by the optimizer
            counter = 0
            inf_streak += 1
            if inf_streak >= hysteresis:     # hysteresis=1: back off on every overflow
                scale = max(scale * backoff_factor, min_scale)
        else:
            inf_streak = 0
            counter += 1
            if counter == growth_interval:
                counter = 0
                grown = min(scale * growth_factor, max_scale)
                scale = grown if isfinite(grown) else scale

    With ``initial_scale=2**16``, ``min_scale=None``, ``max_scale=None`` and
    ``hysteresis=1`` the scale sequence is exactly that of ``torch.amp.GradScaler``.
    The update is written with ``torch.where`` on state tensors: it never reads a
    value back to the host, so it is safe inside CUDA graphs and ``torch.compile``.

    Args:
        initial_scale: the starting scale; best set high (an overflow lowers it at once).
        growth_interval: finite steps in a row before the scale grows.
        growth_factor: the factor (> 1) by which the scale grows.
        backoff_factor: the factor (in (0, 1)) by which the scale shrinks on overflow.
        min_scale: the scale never goes below this (``None``: no floor).
        max_scale: the scale never goes above this (``None``: no ceiling).
        hysteresis: consecutive overflowing steps needed before the scale backs off.

    >>> ls = DynamicLossScale(initial_scale=8.0, growth_interval=1, max_scale=16.0)
    >>> for _ in range(3): ls.update(torch.tensor(0.0))
    >>> ls.scale, ls.counter
    (tensor(16.), tensor(0, dtype=torch.int32))
    """

    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    hysteresis: int = 1

    counter: torch.Tensor = _state_field(torch.int32)
    inf_streak: torch.Tensor = _state_field(torch.int32)
    kind: ClassVar[str] = "dynamic"

    def _validate(self) -> None:
        _positive("initial_scale", self.initial_scale)
        _positive("growth_interval", self.growth_interval, integer=True)
        _positive("hysteresis", self.hysteresis, integer=True)
        check_number("growth_factor", self.growth_factor, minimum=1, exclusive=True)
        _positive("backoff_factor", self.backoff_factor)
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        _positive("min_scale", self.min_scale, allow_none=True)
        _positive("max_scale", self.max_scale, allow_none=True)
        low = 0.0 if self.min_scale is None else self.min_scale
        high = math.inf if self.max_scale is None else self.max_scale
        if low > high:
            raise ValueError(
                f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r})"
            )
        if not low <= self.initial_scale <= high:
            raise ValueError(
                f"initial_scale={self.initial_scale!r} lies outside [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}]; choose an initial scale inside it"
            )

    def _initial_state(self) -> dict[str, float]:
        return {"scale": float(self.initial_scale), "counter": 0, "inf_streak": 0}

    @staticmethod
    def symmetric_config(
        initial_scale: float, growth_interval: int, factor: float
    ) -> dict[str, Any]:
        """The hyperparameters of the classic rule: multiply by ``factor`` after
        ``growth_interval`` finite steps, divide by it on overflow, never below 1, no
        ceiling (growth stops only where the scale would become infinite).

        >>> DynamicLossScale(**DynamicLossScale.symmetric_config(8.0, 2, 4.0))
        DynamicLossScale(initial_scale=8.0, growth_interval=2, growth_factor=4.0, \
backoff_factor=0.25, min_scale=1.0, max_scale=None, hysteresis=1)
        """
        check_number("factor", factor, minimum=1, exclusive=True)
        return {
            "initial_scale": initial_scale,
            "growth_interval": growth_interval,
            "growth_factor": float(factor),
            "backoff_factor": 1.0 / float(factor),
            "min_scale": 1.0,
            "max_scale": None,
        }

    def update(self, found_inf: torch.Tensor) -> None:
        """Apply the rule in the class docstring. Branch-free; no host sync.

        Written with in-place arithmetic on the state tensors (about 15 small kernels):
        the state is updated where it lives, so anyone holding these tensors (a CUDA
        graph, a second optimizer sharing this loss scale) sees the new values.
        """
        found = found_inf.to(self.scale.device, non_blocking=True) > 0
        # inf_streak = inf_streak + 1 on overflow, else 0; counter the other way round.
        self.inf_streak.add_(1).mul_(found)
        self.counter.add_(1).mul_(~found)
        grow = self.counter >= self.growth_interval  # implies a finite step
        self.counter.masked_fill_(grow, 0)
        back_off = self.inf_streak >= self.hysteresis  # implies an overflowing step
        factor = torch.where(
            back_off, self.backoff_factor, torch.where(grow, self.growth_factor, 1.0)
        )
        scale = self.scale * factor
        if self.min_scale is not None or self.max_scale is not None:
            scale.clamp_(min=self.min_scale, max=self.max_scale)
        if self.max_scale is None:
            # Growth past float32's range keeps the old scale, as GradScaler does.
            scale = torch.where(scale != math.inf, scale, self.scale)
        self.scale.copy_(scale)


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
