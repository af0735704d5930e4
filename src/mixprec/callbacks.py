"""Training callbacks: hooks a trainer calls with a :class:`RunState` snapshot.

A trainer drives callbacks in this order (``state`` is one mutable
:class:`RunState` it keeps up to date)::

    on_train_begin(state)           # state.epoch = epochs already done (0, or k on resume)
    for each epoch:
        state.epoch += 1; state.step_in_epoch = 0
        on_epoch_begin(state)
        for each batch:
            ... forward, scaled backward, optimizer step (maybe skipped) ...
            state.step += 1; state.step_in_epoch += 1; state.loss = ...; state.skipped = ...
            on_step_end(state)
        state.metrics = {"loss": mean train loss, "accuracy": ..., "val_accuracy": ...}
        on_epoch_end(state)         # a callback may set state.stop_training = True
        if state.stop_training: break
    on_train_end(state)

Callbacks that print use ``tqdm.write`` so their lines do not tear a progress bar.

>>> state = RunState(epochs=1, steps_per_epoch=2)
>>> hist = History()
>>> cbs = CallbackList([LossMonitor(), hist])
>>> cbs.on_train_begin(state)
>>> state.epoch = 1
>>> for loss in (0.75, 0.5):
...     state.step += 1; state.step_in_epoch += 1; state.loss = loss
...     cbs.on_step_end(state)
epoch: 1 step: 1, loss is 0.75
epoch: 1 step: 2, loss is 0.5
>>> hist.losses
[0.75, 0.5]
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from tqdm.auto import tqdm

__all__ = [
    "RunState",
    "Callback",
    "CallbackList",
    "LossMonitor",
    "LossScaleMonitor",
    "ProgressBar",
    "History",
    "CSVLogger",
    "EarlyStopping",
    "ModelCheckpoint",
    "LRScheduler",
    "format_loss",
]


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

    >>> cbs = CallbackList([History()])
    >>> len(cbs), type(cbs[0]).__name__
    (1, 'History')
    """

    def __init__(self, callbacks: Iterable[Callback] | None = None) -> None:
        self.callbacks: list[Callback] = []
        for cb in callbacks or ():
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"callbacks must be mixprec.callbacks.Callback instances, got "
                    f"{type(cb).__name__} {cb!r}; subclass Callback and override its hooks"
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
        # another order, or fewer of them, and each still finds its own state.
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore each callback from the entry saved under its class name and occurrence."""
        for key, cb in zip(self._keys(), self.callbacks):
            if key in state_dict:
                cb.load_state_dict(state_dict[key])


def _non_negative_int(name: str, value: Any, example: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}; pass e.g. {name}={example}")
    return value


def _emit(line: str, file: IO[str] | None) -> None:
    # Resolve sys.stdout at call time so redirection (and pytest capture) applies.
    tqdm.write(line, file=file if file is not None else sys.stdout)


def format_loss(loss: float) -> str:
    """Format a loss the way MindSpore's LossMonitor shows it (shortest float32 text).

    >>> format_loss(2.301896572113037)
    '2.3018966'
    """
    return str(np.float32(loss))


class LossMonitor(Callback):
    """Print ``epoch: E step: S, loss is L`` every ``per_print_times`` steps.

    ``S`` is the step within the epoch and ``L`` the step's loss as float32, the
    line MindSpore's ``LossMonitor`` prints. ``per_print_times=0`` prints nothing.
    Steps are counted over the whole run, so a resumed run prints on the same steps.

    >>> mon = LossMonitor(per_print_times=2)
    >>> for step in (1, 2, 3, 4):
    ...     mon.on_step_end(RunState(epoch=1, step=step, step_in_epoch=step, loss=2.3018966))
    epoch: 1 step: 2, loss is 2.3018966
    epoch: 1 step: 4, loss is 2.3018966
    """

    def __init__(self, per_print_times: int = 1, file: IO[str] | None = None) -> None:
        self.per_print_times = _non_negative_int("per_print_times", per_print_times, 1)
        self.file = file

    def on_step_end(self, state: RunState) -> None:
        """Print the loss line when the global step is a multiple of ``per_print_times``."""
        if self.per_print_times and state.step % self.per_print_times == 0:
            _emit(
                f"epoch: {state.epoch} step: {state.step_in_epoch}, "
                f"loss is {format_loss(state.loss)}",
                self.file,
            )


class LossScaleMonitor(Callback):
    """Record the loss scale and skipped steps; print a line per epoch and per change.

    ``scales``/``skipped`` hold one entry per step; ``changes`` lists
    ``(step, old_scale, new_scale)`` whenever the scale moved. With ``per_epoch``,
    each epoch ends with ``epoch: E loss scale is X, skipped steps: k of n (total t)``;
    with ``on_change``, every scale change is printed as it happens.

    >>> mon = LossScaleMonitor(on_change=True)
    >>> s = RunState(epoch=1)
    >>> for scale, skip in ((4.0, False), (2.0, True), (2.0, False)):
    ...     s.step += 1; s.step_in_epoch += 1; s.loss_scale = scale; s.skipped = skip
    ...     s.skipped_steps += skip
    ...     mon.on_step_end(s)
    epoch: 1 step: 2, loss scale 4.0 -> 2.0 (step skipped)
    >>> mon.on_epoch_end(s)
    epoch: 1 loss scale is 2.0, skipped steps: 1 of 3 (total 1)
    """

    def __init__(
        self, per_epoch: bool = True, on_change: bool = False, file: IO[str] | None = None
    ) -> None:
        self.per_epoch = per_epoch
        self.on_change = on_change
        self.file = file
        self.scales: list[float] = []
        self.skipped: list[bool] = []
        self.changes: list[tuple[int, float, float]] = []
        self._epoch_skipped = 0

    def on_epoch_begin(self, state: RunState) -> None:
        """Start counting this epoch's skipped steps."""
        self._epoch_skipped = 0

    def on_step_end(self, state: RunState) -> None:
        """Record this step's scale and whether it was skipped."""
        scale = float(state.loss_scale)
        if self.scales and scale != self.scales[-1]:
            self.changes.append((state.step, self.scales[-1], scale))
            if self.on_change:
                why = " (step skipped)" if state.skipped else ""
                _emit(
                    f"epoch: {state.epoch} step: {state.step_in_epoch}, loss scale "
                    f"{self.scales[-1]} -> {scale}{why}",
                    self.file,
                )
        self.scales.append(scale)
        self.skipped.append(bool(state.skipped))
        self._epoch_skipped += bool(state.skipped)

    def on_epoch_end(self, state: RunState) -> None:
        """Print the epoch's final scale and skipped-step count."""
        if self.per_epoch:
            _emit(
                f"epoch: {state.epoch} loss scale is {float(state.loss_scale)}, skipped steps: "
                f"{self._epoch_skipped} of {state.step_in_epoch} (total {state.skipped_steps})",
                self.file,
            )


class ProgressBar(Callback):
    """Show tqdm bars for epochs and for steps, with loss, scale and throughput.

    The step bar's postfix shows the last loss, the loss scale, the total of skipped
    steps and samples per second; the epoch bar's shows the epoch metrics. Bars go
    to ``file`` (default: standard error); ``disable=True`` hides them.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = ProgressBar(file=out, mininterval=0)
    >>> s = RunState(epochs=1, steps_per_epoch=1)
    >>> bar.on_train_begin(s); s.epoch = 1; bar.on_epoch_begin(s)
    >>> s.step = s.step_in_epoch = 1; s.loss = 0.5; s.loss_scale = 1024.0
    >>> bar.on_step_end(s); s.metrics = {"accuracy": 0.75}
    >>> bar.on_epoch_end(s); bar.on_train_end(s)
    >>> "scale=1024" in out.getvalue(), "accuracy=0.75" in out.getvalue()
    (True, True)
    """

    def __init__(
        self, file: IO[str] | None = None, disable: bool = False, mininterval: float = 0.1
    ) -> None:
        self.file = file
        self.disable = disable
        self.mininterval = mininterval
        self._epoch_bar: tqdm | None = None
        self._step_bar: tqdm | None = None

    def _bar(self, **kwargs: Any) -> tqdm:
        return tqdm(
            file=self.file if self.file is not None else sys.stderr,
            disable=self.disable,
            mininterval=self.mininterval,
            dynamic_ncols=True,
            **kwargs,
        )

    def on_train_begin(self, state: RunState) -> None:
        """Open the epoch bar, starting at the epochs already done."""
        self._epoch_bar = self._bar(
            total=state.epochs, initial=state.epoch, desc="training", unit="epoch"
        )

    def on_epoch_begin(self, state: RunState) -> None:
        """Open this epoch's step bar."""
        self._step_bar = self._bar(
            total=state.steps_per_epoch, desc=f"epoch {state.epoch}", unit="step", leave=False
        )

    def on_step_end(self, state: RunState) -> None:
        """Advance the step bar and refresh its postfix."""
        if self._step_bar is None:
            return
        # refresh=False: tqdm redraws at most every mininterval, not on every step.
        self._step_bar.set_postfix(
            loss=format_loss(state.loss),
            scale=f"{state.loss_scale:g}",
            skipped=state.skipped_steps,
            samples_s=f"{state.samples_per_s:.0f}",
            refresh=False,
        )
        self._step_bar.update(1)

    def on_epoch_end(self, state: RunState) -> None:
        """Close the step bar and show the epoch metrics on the epoch bar."""
        if self._step_bar is not None:
            self._step_bar.close()
            self._step_bar = None
        if self._epoch_bar is not None:
            self._epoch_bar.set_postfix(
                {k: f"{v:.4g}" for k, v in state.metrics.items()}, refresh=False
            )
            self._epoch_bar.update(1)

    def on_train_end(self, state: RunState) -> None:
        """Close any open bar."""
        for bar in (self._step_bar, self._epoch_bar):
            if bar is not None:
                bar.close()
        self._step_bar = self._epoch_bar = None


class History(Callback):
    """Keep per-step loss, scale and skip flags and per-epoch metrics for plots.

    ``metrics[name]`` lines up with ``epochs``; an epoch that did not report a name
    has ``nan`` there. Nothing is cleared at ``on_train_begin``, so a continued run
    extends the same history; call :meth:`reset` to start over.

    >>> h = History()
    >>> h.on_epoch_end(RunState(epoch=1, metrics={"loss": 0.5}))
    >>> h.on_epoch_end(RunState(epoch=2, metrics={"loss": 0.25, "val_accuracy": 0.9}))
    >>> h.epochs, h.metrics["val_accuracy"][1], math.isnan(h.metrics["val_accuracy"][0])
    ([1, 2], 0.9, True)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Clear everything recorded."""
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.loss_scales: list[float] = []
        self.skipped: list[bool] = []
        self.epochs: list[int] = []
        self.metrics: dict[str, list[float]] = {}

    def on_step_end(self, state: RunState) -> None:
        """Append this step's global index, loss, scale and skip flag."""
        self.steps.append(state.step)
        self.losses.append(float(state.loss))
        self.loss_scales.append(float(state.loss_scale))
        self.skipped.append(bool(state.skipped))

    def on_epoch_end(self, state: RunState) -> None:
        """Append this epoch's metrics, padding names it did not report with nan."""
        for name in state.metrics:
            if name not in self.metrics:
                self.metrics[name] = [math.nan] * len(self.epochs)
        self.epochs.append(state.epoch)
        for name, values in self.metrics.items():
            values.append(float(state.metrics.get(name, math.nan)))

    def state_dict(self) -> dict[str, Any]:
        """Return every recorded list (plain Python values)."""
        return {
            "steps": list(self.steps),
            "losses": list(self.losses),
            "loss_scales": list(self.loss_scales),
            "skipped": list(self.skipped),
            "epochs": list(self.epochs),
            "metrics": {k: list(v) for k, v in self.metrics.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the recorded history with a saved one."""
        self.reset()
        self.steps = list(state_dict["steps"])
        self.losses = list(state_dict["losses"])
        self.loss_scales = list(state_dict["loss_scales"])
        self.skipped = list(state_dict["skipped"])
        self.epochs = list(state_dict["epochs"])
        self.metrics = {k: list(v) for k, v in state_dict["metrics"].items()}


class CSVLogger(Callback):
    """Write one CSV row per epoch: counters, loss scale, throughput and metrics.

    Columns: ``epoch, step, loss_scale, skipped_steps, samples_per_s`` and then each
    metric name in first-seen order. A metric that appears in a later epoch (e.g.
    validation every few epochs) adds a column and the file is rewritten with it;
    missing values are left empty. The file is closed after every row, so it is
    complete whenever a run stops. With ``append=True`` an existing file is kept,
    minus rows for epochs after the one a resumed run starts from.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
    >>> log = CSVLogger(path)
    >>> s = RunState()
    >>> log.on_train_begin(s)
    >>> s.epoch, s.step, s.metrics = 1, 10, {"loss": 0.5}
    >>> log.on_epoch_end(s)
    >>> print(open(path).read().strip())
    epoch,step,loss_scale,skipped_steps,samples_per_s,loss
    1,10,1.0,0,0.0,0.5
    """

    BASE_COLUMNS = ("epoch", "step", "loss_scale", "skipped_steps", "samples_per_s")

    def __init__(self, path: str | Path, append: bool = False) -> None:
        if not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a str or Path, got {type(path).__name__} {path!r}")
        self.path = Path(path)
        self.append = append
        self._fields: list[str] = list(self.BASE_COLUMNS)
        self._rows: list[dict[str, Any]] = []

    def on_train_begin(self, state: RunState) -> None:
        """Load the rows to keep (``append``) and write the file afresh."""
        self._fields = list(self.BASE_COLUMNS)
        self._rows = []
        if self.append and self.path.is_file():
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                for name in reader.fieldnames or ():
                    if name not in self._fields:
                        self._fields.append(name)
                # Rows past the resume point belong to the abandoned part of the old run.
                self._rows = [r for r in reader if int(r["epoch"]) <= state.epoch]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite()

    def _rewrite(self) -> None:
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._fields, restval="")
            writer.writeheader()
            writer.writerows(self._rows)

    def on_epoch_end(self, state: RunState) -> None:
        """Add this epoch's row."""
        row: dict[str, Any] = {
            "epoch": state.epoch,
            "step": state.step,
            "loss_scale": repr(float(state.loss_scale)),
            "skipped_steps": state.skipped_steps,
            "samples_per_s": repr(float(state.samples_per_s)),
        }
        for name, value in state.metrics.items():
            row[name] = repr(float(value))
        self._rows.append(row)
        new = [name for name in row if name not in self._fields]
        if new or not self.path.is_file():
            self._fields.extend(new)
            self._rewrite()
            return
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._fields, restval="").writerow(row)


class EarlyStopping(Callback):
    """Stop training when ``state.metrics[monitor]`` stops improving.

    An epoch improves when the value beats the best so far by more than
    ``min_delta`` (lower for ``mode="min"``, higher for ``mode="max"``). After
    ``patience`` epochs in a row without improvement (``patience >= 1``),
    ``state.stop_training`` is set.
    A NaN value never counts as an improvement.

    >>> es = EarlyStopping(monitor="loss", patience=1, verbose=False)
    >>> s = RunState()
    >>> es.on_train_begin(s)
    >>> for epoch, loss in enumerate([1.0, 0.8, 0.9, 0.85], start=1):
    ...     s.epoch, s.metrics = epoch, {"loss": loss}
    ...     es.on_epoch_end(s)
    ...     if s.stop_training: break
    >>> s.epoch, es.best, es.best_epoch
    (3, 0.8, 2)
    """

    def __init__(
        self,
        monitor: str = "loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "min",
        verbose: bool = True,
        file: IO[str] | None = None,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"monitor must be a metric name, got {monitor!r}; e.g. 'val_loss'")
        if mode not in ("min", "max"):
            raise ValueError(
                f"mode must be 'min' or 'max', got {mode!r}; use 'min' for losses and 'max' "
                "for accuracies"
            )
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"min_delta must be a number >= 0, got {min_delta!r}")
        self.monitor = monitor
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"patience must be an int >= 1, got {patience!r}; pass e.g. patience=3"
            )
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = mode
        self.verbose = verbose
        self.file = file
        self._restored = False
        self._reset()

    def _reset(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch = 0
        self.wait = 0
        self.stopped_epoch = 0

    def _improves(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_train_begin(self, state: RunState) -> None:
        """Start a fresh count, unless progress was just restored from a checkpoint."""
        if not self._restored:
            self._reset()
        self._restored = False

    def on_epoch_end(self, state: RunState) -> None:
        """Update the best value and patience count; request a stop when patience runs out."""
        if self.monitor not in state.metrics:
            raise ValueError(
                f"EarlyStopping monitors {self.monitor!r}, which is not among this epoch's "
                f"metrics {sorted(state.metrics)}; pass monitor= one of those"
            )
        value = float(state.metrics[self.monitor])
        if self._improves(value):
            self.best, self.best_epoch, self.wait = value, state.epoch, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            state.stop_training = True
            self.stopped_epoch = state.epoch
            if self.verbose:
                _emit(
                    f"early stopping at epoch {state.epoch}: {self.monitor} has not improved "
                    f"for {self.wait} epoch(s); best {self.best:.6g} at epoch {self.best_epoch}",
                    self.file,
                )

    def state_dict(self) -> dict[str, Any]:
        """Return the best value, its epoch and the patience count."""
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore progress; the next ``on_train_begin`` keeps it."""
        self.best = float(state_dict["best"])
        self.best_epoch = int(state_dict["best_epoch"])
        self.wait = int(state_dict["wait"])
        self._restored = True


class ModelCheckpoint(Callback):
    """Save a checkpoint every ``every_n_epochs`` epochs through a saving function.

    This callback decides *when* and *where*; the trainer knows *what* to save
    (model, optimizer with master weights, loss-scale state). It calls
    ``save_fn(path, state)`` if given, else ``state.save_checkpoint(path)``, which
    the trainer sets. Files are named ``filename.format(epoch=..., step=...)``
    inside ``directory``. ``keep_last=k`` deletes this callback's older files beyond
    the newest ``k``. ``save_on_train_end`` also saves the final epoch when the
    schedule skipped it (e.g. after early stopping).

    >>> import tempfile
    >>> saved = []
    >>> ckpt = ModelCheckpoint(tempfile.mkdtemp(), every_n_epochs=2,
    ...                        save_fn=lambda path, state: saved.append(path.name))
    >>> for epoch in (1, 2, 3):
    ...     ckpt.on_epoch_end(RunState(epoch=epoch))
    >>> ckpt.on_train_end(RunState(epoch=3))
    >>> saved
    ['epoch0002.pt', 'epoch0003.pt']
    """

    def __init__(
        self,
        directory: str | Path,
        every_n_epochs: int = 1,
        filename: str = "epoch{epoch:04d}.pt",
        save_fn: Callable[[Path, RunState], None] | None = None,
        keep_last: int | None = None,
        save_on_train_end: bool = True,
    ) -> None:
        if not isinstance(directory, (str, Path)):
            raise TypeError(
                f"directory must be a str or Path, got {type(directory).__name__} {directory!r}"
            )
        if (
            isinstance(every_n_epochs, bool)
            or not isinstance(every_n_epochs, int)
            or every_n_epochs < 1
        ):
            raise ValueError(
                f"every_n_epochs must be an int >= 1, got {every_n_epochs!r}; pass e.g. "
                "every_n_epochs=1"
            )
        try:
            name = filename.format(epoch=1, step=1)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"filename must be a str.format template using only {{epoch}} and {{step}}, "
                f"got {filename!r} ({exc!r}); e.g. 'epoch{{epoch:04d}}.pt'"
            ) from exc
        if not name or Path(name).name != name:
            raise ValueError(
                f"filename must name a file inside directory, got {filename!r}; "
                "e.g. 'epoch{epoch:04d}.pt'"
            )
        if keep_last is not None:
            if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
                raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if save_fn is not None and not callable(save_fn):
            raise TypeError(f"save_fn must be callable(path, state), got {save_fn!r}")
        self.directory = Path(directory)
        self.every_n_epochs = every_n_epochs
        self.filename = filename
        self.save_fn = save_fn
        self.keep_last = keep_last
        self.save_on_train_end = save_on_train_end
        self.saved: list[Path] = []
        self._last_saved_epoch: int | None = None

    @property
    def last_path(self) -> Path | None:
        """The most recent checkpoint this callback wrote, or ``None``."""
        return self.saved[-1] if self.saved else None

    def _save(self, state: RunState) -> None:
        path = self.directory / self.filename.format(epoch=state.epoch, step=state.step)
        if self.save_fn is None and state.save_checkpoint is None:
            raise RuntimeError(
                "ModelCheckpoint has nothing to save with: pass save_fn=callable(path, state), "
                "or run it under a trainer that sets RunState.save_checkpoint"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.save_fn is not None:
            self.save_fn(path, state)
        else:
            state.save_checkpoint(path)
        self._last_saved_epoch = state.epoch
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        if self.keep_last is not None:
            while len(self.saved) > self.keep_last:
                self.saved.pop(0).unlink(missing_ok=True)

    def on_epoch_end(self, state: RunState) -> None:
        """Save when the epoch number is a multiple of ``every_n_epochs``."""
        if state.epoch % self.every_n_epochs == 0:
            self._save(state)

    def on_train_end(self, state: RunState) -> None:
        """Save the final epoch if it has not been saved yet."""
        if self.save_on_train_end and state.epoch > 0 and self._last_saved_epoch != state.epoch:
            self._save(state)


class LRScheduler(Callback):
    """Step a ``torch.optim.lr_scheduler`` after every applied optimizer step (or epoch).

    A step skipped because of non-finite gradients does not advance the schedule, as
    it does not advance the optimizer's ``iterations``. Its state goes into the
    trainer's checkpoints, so a resumed run continues the schedule where it stopped.

    >>> w = torch.nn.Parameter(torch.zeros(1))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> cb = LRScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    >>> opt.step(); cb.on_step_end(RunState(step=1))
    >>> opt.param_groups[0]["lr"]
    0.5
    """

    def __init__(self, scheduler: Any, interval: str = "step") -> None:
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
            raise TypeError(
                f"scheduler must be a torch.optim.lr_scheduler object, got {type(scheduler).__name__}"
            )
        if interval not in ("step", "epoch"):
            raise ValueError(f"interval must be 'step' or 'epoch', got {interval!r}")
        self.scheduler = scheduler
        self.interval = interval

    def on_step_end(self, state: RunState) -> None:
        if self.interval == "step" and not state.skipped:
            self.scheduler.step()

    def on_epoch_end(self, state: RunState) -> None:
        if self.interval == "epoch":
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict["scheduler"])
