"""Divergence checks for the training loop: a run whose loss or weights stopped being
finite says so at once instead of finishing "successfully" with NaN weights.

Two signals, neither adding a host sync to every step:

* the loss: the loop already reads each step's loss as a float for its callbacks, so
  counting consecutive NaN/inf losses is free; ``loss_steps`` of them in a row (the
  forward pass overflows, or the weights are already gone) is divergence;
* parameters and optimizer state: one fused finite check on the device
  (:func:`mixprec.numerics.any_nonfinite`) read back every ``check_every`` steps, at
  the first step of a run of non-finite losses, and at every epoch end (where the
  epoch metrics sync anyway), so a non-finite weight after an applied step is reported
  within ``check_every`` steps and never saved into an epoch's checkpoint. It catches what a skipped step cannot: finite gradients whose
  update overflows (an infinite learning rate, float16 optimizer state).

The dynamic loss scale's own collapse (``ScaleCollapseError``, raised by the
optimizer) is the third signal; the command line reports all three the same way.

>>> import math, torch
>>> from mixprec.train.callbacks import RunState
>>> guard = DivergenceGuard(loss_steps=2, check_every=None)
>>> net = torch.nn.Linear(2, 2)
>>> guard.after_step(RunState(epoch=1, step=1, loss=math.nan), net, optimizer=None)
>>> guard.after_step(RunState(epoch=1, step=2, loss=math.nan), net, optimizer=None)
Traceback (most recent call last):
...
mixprec.train._divergence.DivergenceError: training diverged at epoch 1, step 2: the loss was NaN or inf for the last 2 steps; ...
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec._checks import check_instance, check_number
from mixprec.numerics import any_nonfinite
from mixprec.train.callbacks import RunState

_ADVICE = (
    "try a lower learning rate, gradient clipping, bfloat16 instead of float16, or a "
    "level that keeps float32 master weights (O2)"
)


class DivergenceError(RuntimeError):
    """Training diverged: the loss stayed NaN/inf, or parameters or optimizer state
    became non-finite. The message says where and what to try."""


DivergenceError.__module__ = __name__


class SkippedStepsError(DivergenceError):
    """Every step of a run (or at least the fraction a caller allows) was skipped for
    inf/NaN gradients: the run learned nothing, however it ended."""


SkippedStepsError.__module__ = __name__


def check_skipped(skipped: int, steps: int, max_fraction: float = 1.0, why: str = "") -> None:
    """Raise :class:`SkippedStepsError` when ``skipped`` of ``steps`` reaches
    ``max_fraction`` (default 1: every step skipped).

    >>> check_skipped(3, 90)
    >>> check_skipped(90, 90)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mixprec.train._divergence.SkippedStepsError: 90 of 90 steps were skipped ...
    """
    if steps <= 0 or skipped < max_fraction * steps:
        return
    limit = "" if max_fraction >= 1 else f" (the limit is {max_fraction:g} of them)"
    raise SkippedStepsError(
        f"{skipped} of {steps} steps were skipped for inf/NaN gradients{limit}, so the run "
        f"learned nothing{why}; use --loss-scale dynamic or a lower static scale, bfloat16 "
        "instead of float16, or check the data"
    )


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer steps (float32 masters included) and its state."""
    if optimizer is None:
        return []
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for per_param in optimizer.state.values():
        tensors.extend(
            v for v in per_param.values() if torch.is_tensor(v) and v.is_floating_point()
        )
    return tensors


def _first_nonfinite(network: torch.nn.Module, optimizer: Any) -> str:
    """Which tensor holds the first NaN/inf, in words (only called once one does)."""
    for name, p in network.named_parameters():
        if not torch.isfinite(p).all():
            return f"parameter {name}"
    for i, group in enumerate(getattr(optimizer, "param_groups", ())):
        for j, p in enumerate(group["params"]):
            if not torch.isfinite(p).all():
                return f"optimizer param_groups[{i}] tensor {j}"
            state = optimizer.state.get(p, {})
            for key, v in state.items():
                if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all():
                    return f"optimizer state {key!r} of param_groups[{i}] tensor {j}"
    return "a parameter or optimizer state"


class DivergenceGuard:
    """Raise :class:`DivergenceError` when training has diverged (see the module).

    Args:
        loss_steps: this many consecutive steps with a NaN/inf loss is divergence
            (``None``: never checked).
        check_every: check parameters and optimizer state every this many steps, and at
            every epoch end (``None``: never).

    Host syncs: one every ``check_every`` steps, one per epoch end and one at each step
    whose loss is the first non-finite one in a row; none on healthy steps.
    """

    def __init__(self, loss_steps: int | None = 20, check_every: int | None = 100) -> None:
        self.loss_steps = check_number(
            "loss_steps",
            loss_steps,
            integer=True,
            minimum=1,
            allow_none=True,
            hint="pass e.g. loss_steps=20, or None not to watch the loss",
        )
        self.check_every = check_number(
            "check_every",
            check_every,
            integer=True,
            minimum=1,
            allow_none=True,
            hint="pass e.g. check_every=100, or None not to check the weights",
        )
        self.bad_losses = 0

    def reset(self) -> None:
        """Forget the current run of non-finite losses (a new ``train`` call)."""
        self.bad_losses = 0

    def after_step(self, state: RunState, network: torch.nn.Module, optimizer: Any) -> None:
        """Count a non-finite ``state.loss`` (a host float already); every ``check_every``
        steps, check the weights."""
        self.bad_losses = 0 if math.isfinite(state.loss) else self.bad_losses + 1
        if self.loss_steps is not None and self.bad_losses >= self.loss_steps:
            raise DivergenceError(
                f"training diverged at epoch {state.epoch}, step {state.step}: the loss was "
                f"NaN or inf for the last {self.bad_losses} steps; {_ADVICE}"
            )
        # A first bad loss may mean the last applied step broke the weights: look now,
        # while the cause is one step old (a sync on bad steps only).
        every = self.check_every
        if every is not None and (self.bad_losses == 1 or state.step % every == 0):
            self.check_weights(state, network, optimizer)

    def check_weights(self, state: RunState, network: torch.nn.Module, optimizer: Any) -> None:
        """Raise if any parameter or optimizer state holds a NaN/inf (one host sync)."""
        if self.check_every is None:
            return
        tensors = [*network.parameters(), *_optimizer_tensors(optimizer)]
        device = tensors[0].device if tensors else torch.device("cpu")
        if bool(any_nonfinite(tensors, device)):
            raise DivergenceError(
                f"training diverged at epoch {state.epoch}, step {state.step}: "
                f"{_first_nonfinite(network, optimizer)} holds NaN or inf after an applied "
                f"optimizer step; {_ADVICE}"
            )


def resolve_guard(
    divergence: DivergenceGuard | bool | None, skip_nonfinite: bool
) -> DivergenceGuard:
    """The guard a ``Model`` runs: ``divergence`` itself if it is one; ``True`` the default
    guard, ``False`` none; ``None`` the default guard unless non-finite updates are applied
    on purpose (``skip_nonfinite=False``).

    >>> resolve_guard(None, skip_nonfinite=False).check_every is None
    True
    """
    what = "a DivergenceGuard, True, False or None"
    check_instance("divergence", divergence, (DivergenceGuard, bool, type(None)), what)
    if isinstance(divergence, DivergenceGuard):
        return divergence
    if skip_nonfinite if divergence is None else divergence:
        return DivergenceGuard()
    return DivergenceGuard(loss_steps=None, check_every=None)
