"""Callbacks that record a run: :class:`History` in memory, :class:`CSVLogger` on disk."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from mixprec._checks import check_instance
from mixprec.train._atomic import append_text, atomic_write
from mixprec.train.callbacks._base import Callback, RunState

#: What :class:`CSVLogger` writes for a value an epoch did not report.
MISSING = "nan"


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
    validation every few epochs) adds a column and the file is rewritten with it. No
    cell is blank: a value an epoch did not report is written ``nan`` (:data:`MISSING`),
    as a metric that was not measured (e.g. ``grad_underflow`` in an epoch with no
    sampled step) reports it, so every row has every column and reads back as
    numbers. The file is closed after every row, so it is
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
        check_instance("path", path, (str, Path), "a str or Path")
        self.path = Path(path)
        self.append = append
        self._fields: list[str] = list(self.BASE_COLUMNS)
        self._rows: list[dict[str, Any]] = []

    def on_train_begin(self, state: RunState) -> None:
        """Load the rows to keep (``append``) and write the file afresh."""
        self._fields = list(self.BASE_COLUMNS)
        self._rows = []
        if self.append and self.path.is_file():
            fields, rows = self.read(self.path)
            self._fields.extend(name for name in fields if name not in self._fields)
            # Rows past the resume point belong to the abandoned part of the old run.
            self._rows = [
                {k: MISSING if v in ("", None) else v for k, v in r.items()}  # older blanks
                for r in rows
                if int(r["epoch"]) <= state.epoch
            ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite()

    @staticmethod
    def read(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
        """The columns and rows of a log this class wrote; a ``ValueError`` naming the
        file and the line when it is damaged (not text, no ``epoch`` column, an epoch
        that is not a whole number), before anything is changed."""
        path = Path(path)
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                fields = list(reader.fieldnames or ())
                if "epoch" not in fields:
                    raise ValueError("line 1: no 'epoch' column")
                rows = list(reader)
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path} is damaged (not text: byte {err.start}); repair or delete it"
            ) from None
        except (csv.Error, ValueError) as err:
            raise ValueError(f"{path} is damaged ({err}); repair or delete it") from None
        for line, row in enumerate(rows, 2):
            text = row.get("epoch")
            if text is None or not text.strip().isdigit():
                raise ValueError(
                    f"{path} is damaged (line {line}: epoch {text!r} is not a whole number); "
                    "repair or delete it"
                )
        return fields, rows

    def _rewrite(self) -> None:
        def write(f: Any) -> None:
            text = io.StringIO(newline="")
            writer = csv.DictWriter(text, fieldnames=self._fields, restval=MISSING)
            writer.writeheader()
            writer.writerows(self._rows)
            f.write(text.getvalue().encode("utf-8"))

        atomic_write(self.path, write, fsync=False)

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
        text = io.StringIO(newline="")
        csv.DictWriter(text, fieldnames=self._fields, restval=MISSING).writerow(row)
        append_text(self.path, text.getvalue())
