"""The loss-scale interface (:class:`LossScale`), the fixed scales and :class:`ScaleCollapseError`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from mixprec._checks import check_number
from mixprec.numerics import unscale_and_check_

__all__ = ["LossScale", "NoOpLossScale", "StaticLossScale", "ScaleCollapseError"]


class ScaleCollapseError(RuntimeError):
    """The dynamic loss scale sat at its floor while every step overflowed.

    Raised by the optimizers that own a :class:`DynamicLossScale` once it has backed
    off to ``min_scale`` and steps kept overflowing there for ``collapse_after``
    consecutive steps: no scale can make these gradients finite, so training has
    stopped making progress (usually a diverged model, a too-high learning rate, or
    a layer whose activations overflow the low-precision dtype).
    """


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
    #: State fields newer than the first release (zero when an old checkpoint lacks them).
    _added_state: ClassVar[tuple[str, ...]] = ()

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
        # State added after 0.1.0 may be missing from older checkpoints: it starts at 0.
        state_dict = {**{k: torch.zeros(()) for k in self._added_state}, **state_dict}
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
        self.mark_scaled()
        scale = self.scale if extra_factor == 1.0 else self.scale * extra_factor
        return loss * scale

    # -- who has seen a scaled loss -----------------------------------------------------

    @property
    def needs_scaled_loss(self) -> bool:
        """Whether gradients must come from a scaled loss (a scale other than a fixed 1)."""
        return True

    def _consumers(self) -> dict[int, bool]:
        return self.__dict__.setdefault("_scaled_since_step", {})

    def mark_scaled(self) -> None:
        """Record that a loss was scaled: every consumer's next step may unscale it."""
        consumers = self._consumers()
        for key in consumers:
            consumers[key] = True

    def take_scaled(self, consumer: object) -> bool:
        """Whether a loss was scaled since ``consumer``'s last call (host-side, no sync).

        Optimizers call this once per step to catch gradients that never went through
        a scaled loss (``loss.backward()`` in code that does not know the scale), which
        would otherwise be divided by the scale and train at ~1/scale of the learning rate.
        """
        consumers = self._consumers()
        seen = consumers.get(id(consumer), False)
        consumers[id(consumer)] = False
        return seen

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

    @property
    def needs_scaled_loss(self) -> bool:
        return False


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

    @property
    def needs_scaled_loss(self) -> bool:
        return float(self.loss_scale) != 1.0
