"""``DynamicLossScale``: backs off on overflow, grows after a run of finite steps."""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, ClassVar

import torch

from mixprec._checks import check_number
from mixprec.loss_scale.base import LossScale, _positive, _state_field

__all__ = ["DynamicLossScale"]


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
        collapse_after: overflowing steps in a row at ``min_scale`` (with no floor:
            overflowing steps in a row) after which the scale counts as collapsed:
            :meth:`collapsed` turns true and the optimizers raise
            :class:`ScaleCollapseError`. ``None`` never declares a collapse.

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
    collapse_after: int | None = 100

    counter: torch.Tensor = _state_field(torch.int32)
    inf_streak: torch.Tensor = _state_field(torch.int32)
    floor_streak: torch.Tensor = _state_field(torch.int32)
    kind: ClassVar[str] = "dynamic"
    _added_state: ClassVar[tuple[str, ...]] = ("floor_streak",)

    def _validate(self) -> None:
        _positive("initial_scale", self.initial_scale)
        _positive("growth_interval", self.growth_interval, integer=True)
        _positive("hysteresis", self.hysteresis, integer=True)
        _positive("collapse_after", self.collapse_after, integer=True, allow_none=True)
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
backoff_factor=0.25, min_scale=1.0, max_scale=None, hysteresis=1, collapse_after=100)
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

    def _kernel_rule(self) -> bool:
        """Whether torch's fused ``_amp_update_scale_`` computes this rule exactly.

        It backs off on every overflow and keeps the old scale where growth would be
        infinite; a ceiling is applied after it by a clamp, which agrees as long as
        growing from below the ceiling cannot overflow float32. It multiplies in float64,
        which rounds like this rule's float32 product when both factors are float32 values.
        """
        exact = all(
            struct.unpack("f", struct.pack("f", f))[0] == f
            for f in (self.growth_factor, self.backoff_factor)
        )
        return (
            exact
            and self.hysteresis == 1
            and (self.max_scale is None or self.max_scale * self.growth_factor < 3.4e38)
        )

    def update(self, found_inf: torch.Tensor) -> None:
        """Apply the rule in the class docstring. Branch-free; no host sync.

        Written with in-place arithmetic on the state tensors: the state is updated where
        it lives, so anyone holding these tensors (a CUDA graph, a second optimizer sharing
        this loss scale) sees the new values. With ``hysteresis=1`` the rule is torch's
        fused ``_amp_update_scale_`` kernel (plus a clamp to the floor and ceiling).
        """
        found_inf = found_inf.to(self.scale.device, non_blocking=True)
        found = found_inf > 0
        # inf_streak = inf_streak + 1 on overflow, else 0.
        self.inf_streak.add_(1).mul_(found)
        # Overflowing steps in a row that found the scale at its floor (any scale without one).
        stuck = found if self.min_scale is None else found & (self.scale <= self.min_scale)
        self.floor_streak.add_(1).mul_(stuck)
        if self._kernel_rule():
            torch._amp_update_scale_(
                self.scale, self.counter, found.float(), self.growth_factor,
                self.backoff_factor, self.growth_interval,
            )  # fmt: skip
            if self.min_scale is not None or self.max_scale is not None:
                self.scale.clamp_(min=self.min_scale, max=self.max_scale)
            return
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

    def collapsed(self) -> torch.Tensor | None:
        """True once ``collapse_after`` overflowing steps in a row found the scale at its
        floor (without a floor: once ``collapse_after`` steps in a row overflowed)."""
        if self.collapse_after is None:
            return None
        return self.floor_streak >= self.collapse_after

    def collapse_message(self) -> str:
        where = "at its floor" if self.min_scale is not None else "while backing off"
        return (
            f"the loss scale collapsed: {self.collapse_after} steps in a row overflowed "
            f"{where} (scale {float(self.scale):g}) and were skipped. The gradients are "
            "not finite at any scale: lower the learning rate, check the data for inf/NaN, "
            "keep the overflowing layers in float32 (mixprec.diagnose names them) or train "
            "in bfloat16; collapse_after=None turns this check off"
        )
