"""The callback protocol: :class:`RunState`, :class:`Callback`, :class:`CallbackList`."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from mixprec._checks import check_instance


@dataclass
class RunState:
    """What a trainer tells its callbacks: counters, last step's numbers, epoch metrics.

    ``epoch`` is 1-based while an epoch runs (at ``on_train_begin`` it is the number
    of epochs already done: 0, or k when resuming after epoch k); ``epochs`` is the
    number the run ends at. ``step`` counts optimizer steps over the whole run,
    skipped ones included; ``step_in_epoch`` restarts at 1 each epoch. ``loss`` is
    the last step's loss as a float. ``skipped`` says whether the last step was
    skipped because of non-finite gradients; ``skipped_steps`` totals them.
    ``metrics`` holds the epoch's results, set before ``on_epoch_end``: ``"loss"``
    for the mean training loss, each metric's ``name`` for training metrics and
    ``"val_" + name`` for evaluation. ``save_checkpoint(path)`` is supplied by the
    trainer to write model, optimizer and loss-scale state.

    >>> s = RunState(epoch=2, step=40, step_in_epoch=8)
    >>> s.stop_training, math.isnan(s.loss), s.loss_scale
    (False, True, 1.0)
    """

    epoch: int = 0
    epochs: int | None = None
    step: int = 0
    step_in_epoch: int = 0
    steps_per_epoch: int | None = None
    loss: float = math.nan
    loss_scale: float = 1.0
    skipped: bool = False
    skipped_steps: int = 0
    samples_per_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    stop_training: bool = False
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    save_checkpoint: Callable[[Path], None] | None = None


class Callback:
    """Base class: every hook does nothing, so a subclass overrides only what it needs.

    ``state_dict``/``load_state_dict`` let a trainer put a callback's progress (e.g.
    early-stopping patience) into a checkpoint; stateless callbacks keep the empty
    default.

    >>> class CountSteps(Callback):
    ...     def __init__(self):
    ...         self.n = 0
    ...     def on_step_end(self, state):
    ...         self.n += 1
    >>> c = CountSteps(); c.on_step_end(RunState()); c.n
    1
    """

    def on_train_begin(self, state: RunState) -> None:
        """Called once before the first epoch."""

    def on_epoch_begin(self, state: RunState) -> None:
        """Called at the start of each epoch, after ``state.epoch`` is advanced."""

    def on_step_end(self, state: RunState) -> None:
        """Called after each optimizer step (skipped or not)."""

    def on_epoch_end(self, state: RunState) -> None:
        """Called after each epoch, with ``state.metrics`` filled in."""

    def on_train_end(self, state: RunState) -> None:
        """Called once after the last epoch, or after a stop request."""

    def state_dict(self) -> dict[str, Any]:
        """Return this callback's progress for a checkpoint (empty: nothing to keep)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore progress saved by :meth:`state_dict`."""


class CallbackList(Callback):
    """Call each callback's hook in order; a trainer holds one of these.

    >>> cbs = CallbackList([Callback(), Callback()])
    >>> len(cbs), type(cbs[0]).__name__
    (2, 'Callback')
    """

    def __init__(self, callbacks: Iterable[Callback] | None = None) -> None:
        self.callbacks: list[Callback] = []
        for i, cb in enumerate(callbacks or ()):
            check_instance(
                f"callbacks[{i}]",
                cb,
                Callback,
                "a mixprec.train.callbacks.Callback",
                hint="subclass Callback and override its hooks",
            )
            self.callbacks.append(cb)

    def __len__(self) -> int:
        return len(self.callbacks)

    def __getitem__(self, index: int) -> Callback:
        return self.callbacks[index]

    def on_train_begin(self, state: RunState) -> None:
        """Run every callback's ``on_train_begin``."""
        for cb in self.callbacks:
            cb.on_train_begin(state)

    def on_epoch_begin(self, state: RunState) -> None:
        """Run every callback's ``on_epoch_begin``."""
        for cb in self.callbacks:
            cb.on_epoch_begin(state)

    def on_step_end(self, state: RunState) -> None:
        """Run every callback's ``on_step_end``."""
        for cb in self.callbacks:
            cb.on_step_end(state)

    def on_epoch_end(self, state: RunState) -> None:
        """Run every callback's ``on_epoch_end``."""
        for cb in self.callbacks:
            cb.on_epoch_end(state)

    def on_train_end(self, state: RunState) -> None:
        """Run every callback's ``on_train_end``."""
        for cb in self.callbacks:
            cb.on_train_end(state)

    def _keys(self) -> list[str]:
        # "History:0", "EarlyStopping:0", ...: a resumed run may pass its callbacks in
        # another order, and each still finds its own state.
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            keys.append(f"{name}:{seen.get(name, 0)}")
            seen[name] = seen.get(name, 0) + 1
        return keys

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"History:0": its state, ...}`` for callbacks that have state."""
        return {key: sd for key, cb in zip(self._keys(), self.callbacks) if (sd := cb.state_dict())}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` when ``state_dict`` holds the state of a callback that is
        not in this list: restoring the others would drop that progress without a word
        (an ``EarlyStopping``'s patience count, a schedule's position).

        >>> cbs = CallbackList([Callback()])
        >>> cbs.check_state_dict({"EarlyStopping:0": {"wait": 1}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: it holds the state of callbacks EarlyStopping:0, which this run does not have; ...
        """
        keys = set(self._keys())
        foreign = [key for key in state_dict if key not in keys]
        if foreign:
            raise ValueError(
                f"it holds the state of callbacks {', '.join(map(str, foreign))}, which this "
                "run does not have; pass the same callbacks as the run that saved it, so "
                "that their progress is restored"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore each callback from the entry saved under its class name and occurrence;
        state for a callback not in this list is a ``ValueError`` (:meth:`check_state_dict`),
        raised before any callback is restored."""
        self.check_state_dict(state_dict)
        for key, cb in zip(self._keys(), self.callbacks):
            if key in state_dict:
                cb.load_state_dict(state_dict[key])


def _emit(line: str, file: IO[str] | None) -> None:
    # Through tqdm, so that a line does not tear a progress bar; imported on first use.
    from tqdm.auto import tqdm

    # Resolve sys.stdout at call time so redirection (and pytest capture) applies.
    tqdm.write(line, file=file if file is not None else sys.stdout)


def format_loss(loss: float) -> str:
    """Format a loss the way MindSpore's LossMonitor shows it (shortest float32 text).

    >>> format_loss(2.301896572113037)
    '2.3018966'
    """
    import numpy as np  # imported on first use

    return str(np.float32(loss))
