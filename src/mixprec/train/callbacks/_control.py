"""Callbacks that act on a run: early stopping, checkpoints, learning-rate schedules."""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch  # noqa: F401  (the doctests use it)

from mixprec._checks import check_choice, check_instance, check_number
from mixprec.train.callbacks._base import Callback, RunState, _emit


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
        hint = "pass e.g. monitor='val_loss'"
        check_instance("monitor", monitor, str, "a metric name", hint=hint)
        if not monitor:
            raise ValueError(f"monitor must be a metric name, got ''; {hint}")
        check_choice(
            "mode", mode, ("min", "max"), hint="use 'min' for losses and 'max' for accuracies"
        )
        self.monitor = monitor
        self.patience = check_number(
            "patience", patience, integer=True, minimum=1, hint="pass e.g. patience=3"
        )
        self.min_delta = check_number("min_delta", min_delta, minimum=0)
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
    inside ``directory``. ``keep_last=k`` keeps the newest ``k`` of this callback's
    files after each save and deletes every older one, including those an earlier,
    interrupted run left in ``directory`` (its files are those named by ``filename``;
    :meth:`existing` lists them). ``save_on_train_end`` also saves the final epoch when
    the schedule skipped it (e.g. after early stopping).

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
        check_instance("directory", directory, (str, Path), "a str or Path")
        check_number(
            "every_n_epochs",
            every_n_epochs,
            integer=True,
            minimum=1,
            hint="pass e.g. every_n_epochs=1",
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
        check_number(
            "keep_last",
            keep_last,
            integer=True,
            minimum=1,
            allow_none=True,
            hint="pass e.g. keep_last=2, or None to keep every file",
        )
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

    def _pattern(self) -> re.Pattern[str]:
        parts, seen = [], set()
        for literal, field, _, _ in string.Formatter().parse(self.filename):
            parts.append(re.escape(literal))
            if field is not None:
                parts.append(r"\d+" if field in seen else rf"(?P<{field}>\d+)")
                seen.add(field)
        return re.compile("".join(parts))

    def _order(self, path: Path) -> tuple[int, int]:
        match = self._pattern().fullmatch(path.name)
        found = match.groupdict() if match else {}
        return int(found.get("epoch") or 0), int(found.get("step") or 0)

    def existing(self) -> list[Path]:
        """This callback's files now in ``directory``, oldest first (by epoch, then step).

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in ("epoch0010.pt", "epoch0002.pt", "notes.txt", "epoch0003.pt.tmp"):
        ...     _ = (folder / name).write_text("")
        >>> [p.name for p in ModelCheckpoint(folder).existing()]
        ['epoch0002.pt', 'epoch0010.pt']
        """
        if not self.directory.is_dir():
            return []
        pattern = self._pattern()
        mine = [p for p in self.directory.iterdir() if pattern.fullmatch(p.name) and p.is_file()]
        return sorted(mine, key=lambda p: (self._order(p), p.name))

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
            # Files newer than this one belong to an abandoned timeline (a resume from an
            # older checkpoint) and are overwritten when the run gets there: leave them.
            older = [p for p in self.existing() if self._order(p) <= self._order(path)]
            for stale in older[: -self.keep_last]:
                stale.unlink(missing_ok=True)
            self.saved = [p for p in self.saved if p.exists()]

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
        check_choice("interval", interval, ("step", "epoch"))
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
