"""The loss-scaling engine: loss scales, and the step protocol every optimizer shares.

A loss scale keeps float16 gradients out of underflow. Three kinds share one
interface, so a trainer never branches on the concrete type:

* :class:`NoOpLossScale` - scale 1, never changes (bfloat16 or float32 training).
* :class:`StaticLossScale` - a fixed scale chosen by the user.
* :class:`DynamicLossScale` - backs off on overflow, grows after a run of finite steps.

Each keeps its hyperparameters as plain dataclass fields (``get_config()`` /
``from_config()``) and its state as tensors on the gradients' device
(``state_dict()`` / ``load_state_dict()``); both lists come from the dataclass
fields, so no field can be forgotten. Updates are branch-free tensor arithmetic.

One step, written once here and used by :class:`~mixprec.LossScaleOptimizer`,
:class:`~mixprec.GradScaler`, the trainer integrations and the seed façades::

    scaled = loss_scale.scale_loss(loss); scaled.backward()
    found_inf = loss_scale.unscale_(grads)             # grads /= scale; 1.0 if any inf/NaN
    found_inf = agree_on_found_inf(found_inf, group)   # every rank's verdict
    step_or_skip(optimizer, found_inf)                 # on the device where it can
    loss_scale.update(found_inf)                       # dynamic scales adjust

A loss scale is saved and restored in one format, :func:`loss_scale_state` /
:func:`restore_loss_scale`. Nothing here reads a value back to the host except
:func:`step_or_skip` for an optimizer that cannot skip on the device.

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
import struct
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, overload

import torch
import torch.distributed as dist

from mixprec._checks import check_number
from mixprec.numerics import any_nonfinite, unscale_and_check_

if TYPE_CHECKING:
    from mixprec.typing import LossScaleSpec

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "ScaleCollapseError",
    "loss_scale_from_spec",
    "loss_scale_state",
    "restore_loss_scale",
    "check_process_group",
    "agree_on_found_inf",
    "step_or_skip",
    "refuse_unscaled_gradients",
]

class ScaleCollapseError(RuntimeError):
    """The dynamic loss scale sat at its floor while every step overflowed.

    Raised by the optimizers that own a :class:`DynamicLossScale` once it has backed
    off to ``min_scale`` and steps kept overflowing there for ``collapse_after``
    consecutive steps: no scale can make these gradients finite, so training has
    stopped making progress (usually a diverged model, a too-high learning rate, or
    a layer whose activations overflow the low-precision dtype).
    """


def _state(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The metadata of a dataclass field holding a state tensor of ``dtype``.

    State fields are ``dataclasses.field(init=False, ...)`` written out where they are
    declared, so that type checkers see they are not constructor arguments.
    """
    return {"state": dtype}


def _positive(name: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> None:
    check_number(name, value, integer=integer, minimum=0, exclusive=True, allow_none=allow_none)


#: The scales float32 holds as normal numbers: a scale and its reciprocal both finite.
_FLOAT32 = torch.finfo(torch.float32)


def _a_float32_scale(name: str, value: Any, *, allow_none: bool = False) -> None:
    """A positive scale that float32, where the scale lives, holds with its reciprocal:
    ``1e39`` would be inf (every step skipped), ``1e-40`` a subnormal whose reciprocal
    is inf (the unscaled gradients would be inf or NaN)."""
    _positive(name, value, allow_none=allow_none)
    if value is not None and not _FLOAT32.tiny <= value <= _FLOAT32.max:
        raise ValueError(
            f"{name}={value!r} cannot be held in float32, where loss scales live "
            f"(it would be {float(torch.tensor(value, dtype=torch.float32))!r}); use a value "
            f"in [{_FLOAT32.tiny:.3g}, {_FLOAT32.max:.3g}], in practice 1 to 2**24"
        )


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

    scale: torch.Tensor = dataclasses.field(
        init=False, repr=False, compare=False, metadata=_state(torch.float32)
    )

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
        """The state tensors (copies), for checkpoints; a verdict still waiting for the
        other optimizers sharing this scale (:meth:`update_after`) is applied first."""
        self.settle()
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
        if loss.device != self.scale.device:
            self.to(loss.device)  # state lives where the gradients live: moved once
        if "_waiting" in self.__dict__:
            self.settle()
        scaled = loss * (self.scale if extra_factor == 1.0 else self.scale * extra_factor)
        if scaled.requires_grad and not torch.compiler.is_compiling():  # mark_on_backward,
            scaled.register_hook(self._on_scaled_backward)  # written out: runs every step
        else:
            self.mark_scaled()
        return scaled

    # -- several optimizers, one scale ----------------------------------------------------

    def join(self, consumer: Any) -> None:
        """Count ``consumer`` (an optimizer that steps with this scale) among the sharers
        :meth:`update_after` waits for. Held weakly: a consumer that is gone stops counting.
        Copies and pickles of a loss scale start with no sharers; their optimizers join
        again as they are restored."""
        self.__dict__.setdefault("_sharers", weakref.WeakSet()).add(consumer)

    def update_after(
        self, consumer: Any, found_inf: torch.Tensor, skipped_on_host: bool = False
    ) -> None:
        """``consumer``'s step is done with verdict ``found_inf``: update the scale once
        per iteration, as ``torch.amp.GradScaler.update()`` does after every optimizer of
        the iteration stepped, and watch for a collapse (:meth:`observe_step`, given
        whether the host saw the step skipped; it may raise :class:`ScaleCollapseError`).

        With one consumer, that is now. Several consumers that share this scale each
        unscale by the same scale (the one their losses were multiplied by) and skip only
        their own overflowing step; their verdicts are combined (any overflow backs off
        once) and applied when every sharer has stepped, or at the next
        :meth:`scale_loss` (a GAN's discriminator steps before the generator's loss is
        scaled), or when the state is read for a checkpoint.

        >>> scale = DynamicLossScale(initial_scale=1024.0)
        >>> a, b = torch.optim.SGD([torch.zeros(1)]), torch.optim.SGD([torch.zeros(1)])
        >>> scale.join(a); scale.join(b)
        >>> scale.update_after(a, torch.tensor(1.0)); float(scale.scale)   # b has not stepped
        1024.0
        >>> scale.update_after(b, torch.tensor(0.0)); float(scale.scale)   # once: backed off
        512.0
        """
        sharers = self.__dict__.get("_sharers")
        if sharers is None or len(sharers) <= 1:
            if not self.fixed_at_one:  # a scale fixed at one has nothing to update
                self.update(found_inf=found_inf)
            if skipped_on_host or self.__dict__.get("_host_skips"):
                self.observe_step(skipped_on_host)
            return
        waiting: tuple[torch.Tensor, set[int]] | None = self.__dict__.get("_waiting")
        if waiting is None:
            self.__dict__["_waiting"] = waiting = (found_inf.clone(), set())
        else:
            torch.maximum(waiting[0], found_inf.to(waiting[0].device), out=waiting[0])
        waiting[1].add(id(consumer))
        if {id(c) for c in sharers} <= waiting[1]:
            self.settle()
        self.observe_step(skipped_on_host)

    def settle(self) -> None:
        """Apply the combined verdict that :meth:`update_after` holds, if any."""
        waiting = self.__dict__.pop("_waiting", None)
        if waiting is not None:
            self.update(found_inf=waiting[0])

    def __getstate__(self) -> dict[str, Any]:
        # Sharers are live objects, held weakly: the copy's optimizers join it anew.
        return {k: v for k, v in self.__dict__.items() if k != "_sharers"}

    # -- who has seen a scaled loss -----------------------------------------------------

    @property
    def needs_scaled_loss(self) -> bool:
        """Whether gradients must come from a scaled loss (a scale other than a fixed 1)."""
        return True

    def mark_scaled(self) -> None:
        """Record that gradients of a scaled loss arrived: every consumer's next step may
        unscale them. A host-side count, no sync; it travels with the object (copies and
        pickles of a loss scale and its optimizers keep working)."""
        self.__dict__["_scaled_count"] = self.__dict__.get("_scaled_count", 0) + 1

    def mark_on_backward(self, scaled: torch.Tensor) -> torch.Tensor:
        """``scaled`` (a loss times this scale), marked so that its *backward* records the
        scaled gradients (:meth:`mark_scaled`): the check follows the gradients, not the
        call, so ``scale_loss(loss)`` with the result dropped and ``loss.backward()``
        instead is still refused at the step. Under ``torch.compile`` (where a hook on the
        loss would break the graph) and for a loss without gradient, the call marks."""
        if scaled.requires_grad and not torch.compiler.is_compiling():
            scaled.register_hook(self._on_scaled_backward)
        else:
            self.mark_scaled()
        return scaled

    def _on_scaled_backward(self, grad: torch.Tensor) -> None:
        self.__dict__["_scaled_count"] = self.__dict__.get("_scaled_count", 0) + 1  # mark_scaled

    def take_scaled(self, consumer: Any) -> bool:
        """Whether scaled gradients arrived since ``consumer``'s last call (host-side, no sync).

        Optimizers call this once per step to catch gradients that never went through
        a scaled loss (``loss.backward()`` in code that does not know the scale), which
        would otherwise be divided by the scale and train at ~1/scale of the learning rate.
        The consumer keeps the count it last saw (``_seen_scaled``), so a copy of both
        stays consistent.
        """
        now = self.__dict__.get("_scaled_count", 0)
        seen = getattr(consumer, "_seen_scaled", None)
        # Into its __dict__: an optimizer wrapper's __setattr__ looks names up first.
        vars(consumer)["_seen_scaled"] = now
        return seen is not None and seen != now

    # -- health ---------------------------------------------------------------------

    def collapsed(self) -> torch.Tensor | None:
        """A bool tensor, true once the scale has collapsed (``None``: cannot collapse)."""
        return None

    def raise_if_collapsed(self) -> None:
        """Raise :class:`ScaleCollapseError` if the scale has collapsed (reads one flag)."""
        flag = self.collapsed()
        if flag is not None and bool(flag):
            raise ScaleCollapseError(self.collapse_message())

    def observe_step(self, skipped_on_host: bool) -> None:
        """Called by optimizers that read this step's overflow flag on the host anyway.

        Counts skipped steps in a row on the host and reads the collapse flag (one more
        sync) only once there have been ``collapse_after`` of them, so a healthy run
        pays nothing for the check.
        """
        streak = self.__dict__.get("_host_skips", 0) + 1 if skipped_on_host else 0
        self.__dict__["_host_skips"] = streak
        patience = getattr(self, "collapse_after", None)
        if patience is not None and streak >= patience:
            self.raise_if_collapsed()

    def collapse_message(self) -> str:
        return f"{type(self).__name__} collapsed"

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
        present = [g for g in grads if g is not None]
        if present and present[0].device != self.scale.device:
            self.to(present[0].device)  # a one-time move to the gradients' device
        if extra_factor == 1.0 and self.fixed_at_one:
            # Dividing by 1 changes nothing: read the gradients once for the finite
            # check instead of reading and writing them all (bfloat16 without scaling).
            return any_nonfinite(present, self.scale.device)
        return unscale_and_check_(present, self.inv_scale(extra_factor, scale))

    #: Whether the scale is 1 now and always (no unscale pass, nothing to update).
    fixed_at_one: ClassVar[bool] = False

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
    fixed_at_one: ClassVar[bool] = True

    @property
    def needs_scaled_loss(self) -> bool:
        return False


@dataclasses.dataclass(eq=False, repr=False)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    A fixed scale cannot back off, so a scale too large for the gradients skips every
    step: after ``collapse_after`` overflowing steps in a row (``None``: never) it counts
    as collapsed, and the optimizers raise :class:`ScaleCollapseError`, as for a dynamic
    scale stuck at its floor.

    >>> StaticLossScale(1024.0).scale
    tensor(1024.)
    """

    loss_scale: float = 2.0**15
    collapse_after: int | None = 100
    floor_streak: torch.Tensor = dataclasses.field(
        init=False, repr=False, compare=False, metadata=_state(torch.int32)
    )
    kind: ClassVar[str] = "static"

    def _validate(self) -> None:
        _a_float32_scale("loss_scale", self.loss_scale)
        _positive("collapse_after", self.collapse_after, integer=True, allow_none=True)

    def _initial_state(self) -> dict[str, float]:
        return {"scale": float(self.loss_scale), "floor_streak": 0}

    @property
    def needs_scaled_loss(self) -> bool:
        return float(self.loss_scale) != 1.0

    def update(self, found_inf: torch.Tensor) -> None:
        """Count overflowing steps in a row (the scale itself never changes). No sync."""
        found = found_inf.to(self.scale.device, non_blocking=True) > 0
        self.floor_streak.add_(1).mul_(found)

    def collapsed(self) -> torch.Tensor | None:
        """True once ``collapse_after`` steps in a row overflowed at this scale."""
        return None if self.collapse_after is None else self.floor_streak >= self.collapse_after

    def collapse_message(self) -> str:
        return (
            f"the fixed loss scale {float(self.scale):g} is too large: {self.collapse_after} "
            "steps in a row overflowed and were skipped. Use a smaller loss_scale, "
            "'dynamic', or bfloat16; collapse_after=None turns this check off"
        )


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

    counter: torch.Tensor = dataclasses.field(
        init=False, repr=False, compare=False, metadata=_state(torch.int32)
    )
    inf_streak: torch.Tensor = dataclasses.field(
        init=False, repr=False, compare=False, metadata=_state(torch.int32)
    )
    floor_streak: torch.Tensor = dataclasses.field(
        init=False, repr=False, compare=False, metadata=_state(torch.int32)
    )
    kind: ClassVar[str] = "dynamic"

    def _validate(self) -> None:
        _a_float32_scale("initial_scale", self.initial_scale)
        _positive("growth_interval", self.growth_interval, integer=True)
        _positive("hysteresis", self.hysteresis, integer=True)
        _positive("collapse_after", self.collapse_after, integer=True, allow_none=True)
        check_number("growth_factor", self.growth_factor, minimum=1, exclusive=True)
        _positive("backoff_factor", self.backoff_factor)
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        _a_float32_scale("min_scale", self.min_scale, allow_none=True)
        _a_float32_scale("max_scale", self.max_scale, allow_none=True)
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


def loss_scale_from_spec(spec: LossScaleSpec) -> LossScale:
    """Turn a user's loss-scale choice into a :class:`LossScale`.

    Accepts a ``LossScale`` (returned as is), ``"dynamic"``, ``"none"``/``None``,
    or a positive number (a static scale).

    >>> loss_scale_from_spec(128)
    StaticLossScale(loss_scale=128.0, collapse_after=100)
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


# -- the one saved form of a loss scale ----------------------------------------------


def loss_scale_state(loss_scale: LossScale) -> dict[str, Any]:
    """A loss scale's kind, configuration and state: plain values, ``weights_only``-loadable.

    >>> entry = loss_scale_state(StaticLossScale(8.0))
    >>> entry["kind"], entry["config"], sorted(entry["state"])
    ('static', {'loss_scale': 8.0, 'collapse_after': 100}, ['floor_streak', 'scale'])
    """
    return {
        "kind": loss_scale.kind,
        "config": loss_scale.get_config(),
        "state": loss_scale.state_dict(),
    }


def checked_loss_scale(loss_scale: LossScale, entry: Any) -> LossScale:
    """A fresh loss scale built from ``entry`` (:func:`loss_scale_state`'s output), after
    checking that it fits ``loss_scale``; ``ValueError`` otherwise. Changes nothing."""
    if not isinstance(entry, dict) or set(entry) != {"kind", "config", "state"}:
        raise ValueError(
            f"a saved loss scale has the keys ['config', 'kind', 'state'], got {entry!r:.200}"
        )
    if entry["kind"] != loss_scale.kind:
        raise ValueError(
            f"the checkpoint's loss scale is {entry['kind']!r}, this one is {loss_scale.kind!r}; "
            "resume with the same kind of loss scale"
        )
    configured = type(loss_scale).from_config(entry["config"])  # validates the configuration
    configured.load_state_dict(entry["state"])  # validates the state
    return configured


def restore_loss_scale(loss_scale: LossScale, entry: Any) -> None:
    """Apply :func:`loss_scale_state`'s output to ``loss_scale`` in place (it may be shared).

    Everything is checked first: another kind of loss scale, a bad configuration or
    state is a ``ValueError`` and leaves ``loss_scale`` as it was. The saved
    configuration is applied, as ``torch.amp.GradScaler.load_state_dict`` applies its
    growth settings.
    """
    configured = checked_loss_scale(loss_scale, entry)
    # The dataclass fields, not get_config()'s keys: a seed façade renames those.
    for field in type(loss_scale)._config_fields():
        setattr(loss_scale, field.name, getattr(configured, field.name))
    loss_scale.load_state_dict(entry["state"])


# -- the step: ranks agree, then the optimizer steps or skips ------------------------

#: ``process_group=LOCAL``: every rank decides alone whether to skip.
LOCAL = "local"


def check_process_group(process_group: Any) -> None:
    """Raise ``TypeError`` unless ``process_group`` is ``None``, ``"local"`` or a group.

    >>> check_process_group("everyone")
    Traceback (most recent call last):
    ...
    TypeError: process_group must be None, 'local' or a torch.distributed ProcessGroup, got 'everyone'; ...
    """
    if process_group is None or process_group == LOCAL:
        return
    if dist.is_available() and isinstance(process_group, dist.ProcessGroup):
        return
    raise TypeError(
        "process_group must be None, 'local' or a torch.distributed ProcessGroup, got "
        f"{process_group!r}; pass None to agree over all ranks, 'local' to decide per rank"
    )


def reduction_group(process_group: Any) -> Any:
    """The group to all-reduce over, or ``None`` when there is no other rank to agree with.

    ``torch.distributed``'s own convention: the returned ``dist.group.WORLD`` stands for
    the default group. Asked at every step (cheap host calls), so an optimizer built
    before ``init_process_group`` still agrees once the group exists.
    """
    if process_group == LOCAL or not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if process_group is None else process_group
    return group if dist.get_world_size(group) > 1 else None


@overload
def agree_on_found_inf(found_inf: torch.Tensor, process_group: Any) -> torch.Tensor: ...


@overload
def agree_on_found_inf(found_inf: None, process_group: Any) -> None: ...


def agree_on_found_inf(found_inf: torch.Tensor | None, process_group: Any) -> torch.Tensor | None:
    """All-reduce ``found_inf`` (a 0/1 float tensor, in place) with ``MAX``; return it.

    Under data parallelism a step that one rank skips and another applies leaves the
    ranks apart for the rest of the run, so any rank's overflow is everyone's. The
    all-reduce moves one float (queued on the device under NCCL; a blocking exchange
    of four bytes on gloo). ``None`` (an accumulation window that is not full) passes.

    >>> agree_on_found_inf(torch.tensor(1.0), None)   # no process group: nothing to agree with
    tensor(1.)
    """
    group = None if found_inf is None else reduction_group(process_group)
    if group is not None:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def creates_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step would create optimizer state (a parameter with a gradient and none)."""
    if getattr(optimizer, "_mixprec_keeps_no_state", False):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(optimizer.state) >= len(params):
        return False
    return any(p.grad is not None and not optimizer.state.get(p) for p in params)


def _fused_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    grad_scale: torch.Tensor | None,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """A fused optimizer's step with torch's AMP protocol: it skips (and unscales by
    ``grad_scale``, when given) on the device."""
    # Attributes of torch's protocol (GradScaler sets them too), not of Optimizer's type.
    amp_optimizer: Any = optimizer
    amp_optimizer.found_inf = found_inf
    amp_optimizer.grad_scale = grad_scale
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del amp_optimizer.found_inf
        del amp_optimizer.grad_scale


def step_or_skip(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    *,
    skip: bool = True,
    grad_scale: torch.Tensor | None = None,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
) -> tuple[Any, bool]:
    """Step ``optimizer`` unless ``skip`` and ``found_inf`` (a 0/1 float tensor) is 1.

    Returns ``(what optimizer.step returned, skipped_on_host)``. ``grad_scale``: the
    gradients are still multiplied by it, and a fused optimizer divides them in its
    kernel (``GradScaler``'s fused path).

    Fused optimizers (``_step_supports_amp_scaling``) take the flag and skip on the
    device: no host sync. Any other optimizer costs one ``found_inf.item()``, and so
    does a fused step that would create state (a first step): fused kernels that skip
    still leave the state they allocate behind (SGD's momentum buffers uninitialised,
    Adam's moments at zero), and a skipped step must leave the state as it was.
    """
    kwargs = {} if kwargs is None else kwargs
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if fused and not (skip and creates_state(optimizer)):
        return _fused_step(optimizer, found_inf, grad_scale, args, kwargs), False
    if skip and found_inf.item():  # the one host sync of a non-fused step
        return None, True
    if grad_scale is None:
        result = optimizer.step(*args, **kwargs)
    else:  # a fused first step whose gradients are still scaled: the kernel unscales them
        result = _fused_step(optimizer, torch.zeros_like(found_inf), grad_scale, args, kwargs)
    if fused and not optimizer.state:
        # An applied step that created no state (SGD without momentum) never will: from
        # now on the fused step skips on the device, with no host sync.
        marked: Any = optimizer  # a flag of ours on the optimizer, not in its type
        marked._mixprec_keeps_no_state = True
    return result, False


def refuse_unscaled_gradients(loss_scale: LossScale, param_groups: list[dict[str, Any]]) -> None:
    """Raise ``RuntimeError``: the gradients came from no scaled loss, and dividing them by
    the scale would train at about 1/scale of the learning rate without a word.

    The optimizers ask their loss scale (:meth:`LossScale.take_scaled`, host-side, no
    sync) whether a loss was scaled since their last step, and call this when none was.
    Allowed (returns): a scale that is a fixed 1, and a step at learning rate 0 in
    every group, which changes nothing and is how distributed-checkpoint tools
    (``torch.distributed.checkpoint.state_dict``) create optimizer state.

    >>> refuse_unscaled_gradients(NoOpLossScale(), [{"params": [], "lr": 0.1}])
    >>> refuse_unscaled_gradients(DynamicLossScale(), [{"params": [], "lr": 0.1}])
    Traceback (most recent call last):
    ...
    RuntimeError: step() was called, but no loss was scaled since the last step: ...
    """
    if not loss_scale.needs_scaled_loss:
        return
    if all(float(g.get("lr", 1.0)) == 0.0 for g in param_groups):
        return
    raise RuntimeError(
        "step() was called, but no loss was scaled since the last step: the gradients "
        f"would be divided by the loss scale ({float(loss_scale.scale):g}) and training "
        "would crawl. Call opt.scale_loss(loss).backward() instead of loss.backward() "
        "(scaler.scale(loss).backward() with a GradScaler), let a trainer integration "
        "(mixprec.integrations) scale the loss, or use loss_scale=None"
    )
