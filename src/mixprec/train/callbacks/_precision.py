"""``PrecisionMonitor``: gradient underflow and overflow during training, in the metrics.

The callback attaches a :class:`mixprec.diagnostics.GradientMonitor` to the trainer's
optimizer (its step hooks) and the trainer's model (for names), and

* every ``every`` steps records a sample: the fraction of gradient values that
  underflow (subnormal or zero) or overflow in ``dtype`` at the loss scale in use,
  the exponent range, and the worst layers (``samples``);
* on every skipped step names the gradients that held inf/NaN (``overflows``,
  and a line like ``step 12: overflow in `fc1.weight` gradient (loss scale 32768)``);
* at each epoch's end puts ``grad_underflow`` (the mean over the epoch's samples,
  ``nan`` in an epoch without one) and ``grad_overflow_steps`` into ``state.metrics``, so a :class:`CSVLogger` or
  :class:`History` placed *after* it records them.

Host syncs: none on steps that neither sample nor overflow; one to read a sample and
one to name an overflow (per device and dtype of the gradients). ``summary()`` is the JSON-ready record for a metrics file;
``underflow_series()`` feeds :func:`mixprec.train._plots.plot_loss_scale`.

>>> import io, torch
>>> from mixprec.train.callbacks import RunState
>>> net = torch.nn.Linear(4, 2)
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
>>> mon = PrecisionMonitor(every=2, file=io.StringIO())
>>> state = RunState(epoch=1, model=net, optimizer=opt)
>>> mon.on_train_begin(state)
>>> for step in (1, 2, 3):
...     opt.zero_grad(); net(torch.randn(8, 4)).square().mean().backward(); opt.step()
...     state.step = step; mon.on_step_end(state)
>>> [s["step"] for s in mon.samples], mon.underflow_series()[0]
([1, 3], [1, 3])
>>> mon.on_epoch_end(state); sorted(k for k in state.metrics if k.startswith("grad_"))
['grad_overflow_steps', 'grad_underflow']
>>> mon.on_train_end(state)
"""

from __future__ import annotations

import math
import statistics
from typing import IO, TYPE_CHECKING, Any

import torch

from mixprec._checks import as_low_precision, check_bool, check_number
from mixprec.train.callbacks._base import Callback, RunState, _emit

if TYPE_CHECKING:
    from mixprec.diagnostics._monitor import GradientMonitor


_LISTED = 3  # layer names printed per overflow line before "and N more"


def _listing(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:_LISTED])
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"{shown}{more} gradient{'s' if len(names) > 1 else ''}"


class PrecisionMonitor(Callback):
    """Record gradient precision every ``every`` steps and name overflowing layers.

    Args:
        every: sampling interval in optimizer steps (default 100; steps 1, 101, ...).
        dtype: the low-precision dtype the fractions are for (default float16; pass the
            run's dtype, e.g. ``Model.dtype``).
        verbose: print a line for every overflowing step.
        file: where those lines go (default standard output).
    """

    def __init__(
        self,
        every: int = 100,  # mixprec.diagnostics.DEFAULT_EVERY, not imported here
        dtype: Any = torch.float16,
        verbose: bool = True,
        file: IO[str] | None = None,
    ) -> None:
        # Checked here, so that a bad value fails before training starts.
        self.every = check_number("every", every, integer=True, minimum=1, hint="e.g. every=100")
        self.dtype = as_low_precision(dtype, "dtype")
        self.verbose, self.file = check_bool("verbose", verbose), file
        self.monitor: GradientMonitor | None = None
        self.samples: list[dict[str, Any]] = []
        self.overflows: list[dict[str, Any]] = []
        self._epoch_samples: list[float] = []
        self._epoch_overflows = 0

    def on_train_begin(self, state: RunState) -> None:
        """Attach the gradient monitor to the trainer's optimizer and model."""
        if state.optimizer is None:
            raise ValueError(
                "PrecisionMonitor needs the trainer's optimizer in RunState.optimizer; "
                "use it with mixprec.Model.train"
            )
        # Imported here: mixprec.diagnostics loads when a run starts, not with mixprec.train.
        from mixprec.diagnostics._monitor import GradientMonitor

        if self.monitor is not None:
            self.monitor.remove()
        self.monitor = GradientMonitor(
            state.optimizer, state.model, every=self.every, dtype=self.dtype
        )
        # Sample on the trainer's step grid, so that a resumed run samples the same steps.
        self.monitor.steps = state.step

    def on_epoch_begin(self, state: RunState) -> None:
        self._epoch_samples, self._epoch_overflows = [], 0

    def _read_samples(self, state: RunState) -> None:
        for sample in self.monitor.read_samples():  # one host sync, on sampled steps only
            record = sample.to_dict()
            record["step"] = state.step
            record["worst_layers"] = sample.worst()
            self.samples.append(record)
            self._epoch_samples.append(sample.underflow_fraction)

    def on_step_end(self, state: RunState) -> None:
        """Read a pending sample; name the overflowing gradients of a skipped step."""
        if self.monitor is None:
            return
        self._read_samples(state)
        if state.skipped:
            names = self.monitor.nonfinite()  # one host sync, on overflowing steps only
            self.overflows.append(
                {"step": state.step, "loss_scale": float(state.loss_scale), "layers": names}
            )
            self._epoch_overflows += 1
            if self.verbose:
                what = _listing(names) if names else "the loss (no gradient named)"
                _emit(
                    f"epoch: {state.epoch} step: {state.step_in_epoch}, overflow in {what} "
                    f"(step skipped; loss scale now {float(state.loss_scale):g})",
                    self.file,
                )
        self.monitor.release()  # the step's gradients may go now

    def on_epoch_end(self, state: RunState) -> None:
        """Put this epoch's ``grad_underflow`` and ``grad_overflow_steps`` into the metrics."""
        # Always present, so that logs and progress lines keep one set of columns: nan
        # when no step of this epoch was sampled (``every`` spans epochs).
        samples = self._epoch_samples
        state.metrics["grad_underflow"] = statistics.fmean(samples) if samples else math.nan
        state.metrics["grad_overflow_steps"] = float(self._epoch_overflows)

    def on_train_end(self, state: RunState) -> None:
        """Read what is left and take the hooks off the optimizer."""
        if self.monitor is not None:
            self._read_samples(state)
            self.monitor.remove()
            self.monitor = None

    def underflow_series(self) -> tuple[list[int], list[float]]:
        """``(steps, underflow fractions)`` of the samples, for a plot."""
        return [s["step"] for s in self.samples], [s["underflow_fraction"] for s in self.samples]

    def summary(self) -> dict[str, Any]:
        """Everything recorded, JSON-ready (for a metrics file)."""
        return {
            "every": self.every,
            "dtype": str(self.dtype).replace("torch.", ""),
            "samples": list(self.samples),
            "overflows": list(self.overflows),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "overflows": list(self.overflows)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples = list(state_dict["samples"])
        self.overflows = list(state_dict["overflows"])
