"""Callbacks that show a run as it goes: loss lines, loss-scale health, progress bars."""

from __future__ import annotations

import math
import sys
import time
from typing import IO, TYPE_CHECKING, Any

from mixprec._checks import check_bool, check_number
from mixprec.train.callbacks._base import Callback, RunState, _emit, format_loss

if TYPE_CHECKING:
    from tqdm.auto import tqdm



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
        self.per_print_times = check_number(
            "per_print_times",
            per_print_times,
            integer=True,
            minimum=0,
            hint="pass e.g. per_print_times=1",
        )
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


def scale_text(scale: float) -> str:
    """A loss scale in at most 6 characters: ``65536``, ``2^24``, ``1e-05``, ``3.3e+07``.

    >>> scale_text(32768.0), scale_text(2.0**24), scale_text(1.0), scale_text(3e7)
    ('32768', '2^24', '1', '3e+07')
    """
    text = f"{scale:g}"
    if len(text) <= 6 or not math.isfinite(scale) or scale <= 0:
        return text
    mantissa, exponent = math.frexp(scale)
    if mantissa == 0.5:  # a power of two, as dynamic loss scales are
        return f"2^{exponent - 1}"
    return f"{scale:.2g}"


def rate_text(samples_per_s: float) -> str:
    """Samples per second in a few characters: ``950/s``, ``12k/s``, ``3.4M/s``.

    >>> rate_text(950.4), rate_text(12345.0), rate_text(3.4e6)
    ('950/s', '12k/s', '3.4M/s')
    """
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if samples_per_s >= 10 * size or (unit == "M" and samples_per_s >= size):
            value = samples_per_s / size
            return f"{value:.0f}{unit}/s" if value >= 10 else f"{value:.1f}{unit}/s"
    return f"{samples_per_s:.0f}/s"


class ProgressBar(Callback):
    """Show progress: live tqdm bars on a terminal, one line per epoch elsewhere.

    Live (``live=True``, or by default when the output is a terminal): an epoch bar
    (percentage, epochs, elapsed and remaining time, the last epoch's loss and validation
    accuracy) and a step bar. The step bar's numbers come before the bar itself and fit
    an 80-column terminal whole (the bar shrinks; the numbers are never cut off)::

        epoch 3 12/41, loss 0.4123  scale 2^15  skipped 0  9.8k/s |████▍         |

    (``scale``: the loss scale, powers of two above 6 digits as ``2^k``; ``skipped``: the
    run's total of skipped steps; then samples per second.) Bars go to ``file``
    (default: standard error). Not live (output redirected to a file or a pipe, where
    redrawn bars would pile up as hundreds of lines): one line per epoch, to ``file``
    (default: standard output), every line with the same columns in the same order (a
    metric an epoch did not report shows ``nan``)::

        epoch 3/15  loss 0.1234  accuracy 0.9712  scale 32768  skipped 0  (0.3 s)

    ``disable=True`` shows nothing.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = ProgressBar(file=out)
    >>> s = RunState(epochs=2, steps_per_epoch=1)
    >>> bar.on_train_begin(s); s.epoch = 1; bar.on_epoch_begin(s)
    >>> s.step = s.step_in_epoch = 1; s.loss = 0.5; s.loss_scale = 1024.0
    >>> bar.on_step_end(s); s.metrics = {"loss": 0.5, "accuracy": 0.75}
    >>> bar.on_epoch_end(s); bar.on_train_end(s)
    >>> print(out.getvalue().replace(bar.last_seconds, "T"), end="")
    epoch 1/2  loss 0.5  accuracy 0.75  scale 1024  skipped 0  (T s)
    """

    #: The step bar: its numbers (tqdm's postfix, after ", ") before the bar, which takes
    #: the columns left.
    STEP_FORMAT = "{desc} {n_fmt}/{total_fmt}{postfix} |{bar}|"
    #: The epoch bar, with the last epoch's loss and validation accuracy as its postfix.
    EPOCH_FORMAT = (
        "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
    )

    def __init__(
        self,
        file: IO[str] | None = None,
        disable: bool = False,
        mininterval: float = 0.1,
        live: bool | None = None,
    ) -> None:
        self.file = file
        self.disable = disable
        self.mininterval = mininterval
        if live is not None:
            check_bool("live", live, hint="or None to decide by whether the output is a terminal")
        self.live = live
        self.last_seconds = ""
        self._epoch_bar: tqdm | None = None
        self._step_bar: tqdm | None = None
        self._lines = False
        self._epoch_start = 0.0
        self._columns: list[str] = []  # the metric names of the epoch lines, first seen first

    def _is_live(self) -> bool:
        if self.live is not None:
            return self.live
        stream = self.file if self.file is not None else sys.stderr
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())

    def _bar(self, **kwargs: Any) -> tqdm:
        from tqdm.auto import tqdm  # imported where a bar is shown

        return tqdm(
            file=self.file if self.file is not None else sys.stderr,
            disable=self.disable,
            mininterval=self.mininterval,
            dynamic_ncols=True,
            **kwargs,
        )

    def on_train_begin(self, state: RunState) -> None:
        """Open the epoch bar (live), starting at the epochs already done."""
        self._lines = not self.disable and not self._is_live()
        if self._lines:
            return
        self._epoch_bar = self._bar(
            total=state.epochs,
            initial=state.epoch,
            desc="training",
            unit="epoch",
            bar_format=self.EPOCH_FORMAT,
        )

    def on_epoch_begin(self, state: RunState) -> None:
        """Open this epoch's step bar (live), or start its clock."""
        self._epoch_start = time.perf_counter()
        if self._lines or self._epoch_bar is None:
            return
        self._step_bar = self._bar(
            total=state.steps_per_epoch,
            desc=f"epoch {state.epoch}",
            unit="step",
            leave=False,
            bar_format=self.STEP_FORMAT,
        )

    def on_step_end(self, state: RunState) -> None:
        """Advance the step bar and refresh its numbers."""
        if self._step_bar is None:
            return
        # refresh=False: tqdm redraws at most every mininterval, not on every step.
        self._step_bar.set_postfix_str(
            f"loss {state.loss:.4g}  scale {scale_text(state.loss_scale)}  "
            f"skipped {state.skipped_steps}  {rate_text(state.samples_per_s)}",
            refresh=False,
        )
        self._step_bar.update(1)

    def on_epoch_end(self, state: RunState) -> None:
        """Close the step bar and show the epoch metrics (on the epoch bar, or as a line)."""
        if self._lines:
            self.last_seconds = f"{time.perf_counter() - self._epoch_start:.1f}"
            total = f"/{state.epochs}" if state.epochs else ""
            self._columns += [k for k in state.metrics if k not in self._columns]
            metrics = "".join(f"  {k} {state.metrics.get(k, math.nan):.4g}" for k in self._columns)
            print(
                f"epoch {state.epoch}{total}{metrics}  scale {state.loss_scale:g}  "
                f"skipped {state.skipped_steps}  ({self.last_seconds} s)",
                file=self.file if self.file is not None else sys.stdout,
                flush=True,
            )
            return
        if self._step_bar is not None:
            self._step_bar.close()
            self._step_bar = None
        if self._epoch_bar is not None:
            shown = [k for k in ("loss", "val_accuracy") if k in state.metrics]
            self._epoch_bar.set_postfix_str(
                "  ".join(f"{k} {state.metrics[k]:.4g}" for k in shown), refresh=False
            )
            self._epoch_bar.update(1)

    def on_train_end(self, state: RunState) -> None:
        """Close any open bar."""
        for bar in (self._step_bar, self._epoch_bar):
            if bar is not None:
                bar.close()
        self._step_bar = self._epoch_bar = None
