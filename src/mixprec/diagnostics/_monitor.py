"""``GradientMonitor``: gradient statistics during training, through the optimizer's own hooks.

Attached with torch's ``register_step_pre_hook`` to any ``torch.optim.Optimizer``
(:class:`mixprec.LossScaleOptimizer` included), it sees every step's gradients just
before the optimizer does::

    before each step():
        steps += 1
        last = this step's gradients (references, no copy)    # to name an overflow later
        if steps % every == 1:                                # steps 1, every + 1, ...
            counts[i] = exponent histogram of gradient i      # a few kernels per dtype group
            remember (steps, counts, loss scale)              # all still on the device

Nothing there reads a value back to the host, and steps between samples launch no
kernel at all. :meth:`GradientMonitor.read_samples` copies the pending samples to the
host (one sync per sample). :meth:`GradientMonitor.nonfinite` names the gradients that
held inf/NaN at the last step (one multi-tensor norm and one sync; call it when a step
was skipped, which the trainer already knows): a skipped step leaves its gradients
as they were, and an inf or NaN survives unscaling.

The references to the last step's gradients are dropped by :meth:`release`, by the
model's next forward pass when ``model`` is given, or else by the next step, so that
they do not hold a second set of gradients through the next backward pass. Zeroing
gradients in place (``zero_grad(set_to_none=False)``) before :meth:`nonfinite` leaves it
nothing to name.

With a ``LossScaleOptimizer`` the gradients are still *scaled* when sampled: the
statistics are of the values the low-precision dtype actually held, at the scale in
use (``sample.loss_scale``); ``sample.exponent_range`` is given unscaled.

>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
>>> monitor = GradientMonitor(opt, net, every=2)
>>> for step in range(3):
...     opt.zero_grad(); net(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
>>> [s.step for s in monitor.read_samples()], sorted(monitor.history[0].layers)[:2]
([1, 3], ['0.bias', '0.weight'])
>>> monitor.nonfinite()
[]
>>> monitor.remove()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from mixprec._checks import as_low_precision, check_bool, check_instance, check_number
from mixprec.diagnostics._histogram import NUM_BINS, count_exponents_rows_, dtype_range

#: The default sampling interval, in optimizer steps.
DEFAULT_EVERY = 100
_BIAS = 127  # float32's exponent bias: counter b holds exponent b - 127


@dataclasses.dataclass(frozen=True)
class GradientSample:
    """One sampled step: fractions over all gradients and per layer, in ``dtype``.

    Fractions are of the gradients as the optimizer received them, i.e. multiplied
    by ``loss_scale``: ``underflow_fraction`` became subnormal or zero, ``overflow_fraction``
    is inf/NaN (or would be in ``dtype``), ``zero_fraction`` is exactly zero (including
    values that already underflowed in a low-precision backward). ``exponent_range``
    is of the unscaled gradients. ``layers[name]`` holds the same four per gradient.
    """

    step: int
    loss_scale: float
    dtype: torch.dtype
    underflow_fraction: float
    overflow_fraction: float
    zero_fraction: float
    exponent_range: tuple[int, int] | None
    layers: Mapping[str, dict[str, Any]]

    @classmethod
    def from_rows(
        cls, step: int, scale: float, dtype: torch.dtype, names: list[str], rows: Any
    ) -> GradientSample:
        """From one histogram row (``NUM_BINS`` counters) per gradient, vectorised."""
        counts = np.asarray(rows, dtype=np.int64).reshape(len(names), NUM_BINS)
        shift = math.frexp(scale)[1] - 1 if scale > 0 and math.isfinite(scale) else 0
        rng = dtype_range(dtype)
        # Column b holds exponent b - 127 (0: below 2**-126; 255: inf/nan; 256: zeros).
        per_row = {
            "total": counts.sum(axis=1),
            "under": counts[:, : rng.min_normal + _BIAS].sum(axis=1),
            "over": counts[:, rng.max + _BIAS + 1 : 256].sum(axis=1),
            "zero": counts[:, 256],
        }
        present = counts[:, :255] > 0
        lowest = np.where(present.any(axis=1), present.argmax(axis=1), -1)
        highest = np.where(present.any(axis=1), 254 - present[:, ::-1].argmax(axis=1), -1)

        def summary(total: int, under: int, over: int, zero: int, lo: int, hi: int) -> dict:
            return {
                "underflow_fraction": under / total if total else 0.0,
                "overflow_fraction": over / total if total else 0.0,
                "zero_fraction": zero / total if total else 0.0,
                # Bins are of the scaled values; the range is given unscaled.
                "exponent_range": None if lo < 0 else [lo - _BIAS - shift, hi - _BIAS - shift],
            }

        layers = {
            name: summary(*(int(per_row[k][i]) for k in ("total", "under", "over", "zero")),
                          int(lowest[i]), int(highest[i]))
            for i, name in enumerate(names)
        }  # fmt: skip
        present_any = present.any(axis=0)
        lo = int(present_any.argmax()) if present_any.any() else -1
        hi = int(254 - present_any[::-1].argmax()) if present_any.any() else -1
        whole = summary(*(int(v.sum()) for v in per_row.values()), lo, hi)
        span = whole["exponent_range"]
        return cls(
            step,
            scale,
            dtype,
            whole["underflow_fraction"],
            whole["overflow_fraction"],
            whole["zero_fraction"],
            None if span is None else (span[0], span[1]),
            layers,
        )

    def worst(self, key: str = "underflow_fraction", n: int = 3) -> list[str]:
        """The ``n`` layers with the largest ``key`` (only those above zero)."""
        ranked = sorted(self.layers, key=lambda name: -self.layers[name][key])
        return [name for name in ranked[:n] if self.layers[name][key] > 0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss_scale": self.loss_scale,
            "underflow_fraction": self.underflow_fraction,
            "overflow_fraction": self.overflow_fraction,
            "zero_fraction": self.zero_fraction,
            "exponent_range": list(self.exponent_range) if self.exponent_range else None,
            "layers": {name: dict(v) for name, v in self.layers.items()},
        }


@dataclasses.dataclass
class _Pending:
    step: int
    names: list[str]
    counts: torch.Tensor  # (len(names), NUM_BINS), on the device
    scale: torch.Tensor | None


def _parameter_names(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> list[str]:
    """A name per parameter the optimizer holds, in group order."""
    by_id = {} if model is None else {id(p): n for n, p in model.named_parameters()}
    names = []
    params = _watched(optimizer)
    position = 0
    for i, group in enumerate(optimizer.param_groups):
        group_names = group.get("param_names")
        for j in range(len(group["params"])):
            p = params[position] if position < len(params) else None
            position += 1
            if p is not None and id(p) in by_id:
                names.append(by_id[id(p)])
            elif group_names is not None and j < len(group_names):
                names.append(str(group_names[j]))
            else:
                names.append(f"param_groups[{i}][{j}]")
    return names


def _watched(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # A LossScaleOptimizer with master weights steps float32 copies; the model's own
    # low-precision parameters hold the gradients backward produced.
    model_params = getattr(optimizer, "model_params", None)
    if callable(model_params):
        return list(model_params())
    return [p for group in optimizer.param_groups for p in group["params"]]


def _gradient_scale(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    scale = getattr(optimizer, "loss_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    factor = getattr(optimizer, "loss_scale_factor", None)
    scale = scale.detach().clone()
    return scale if factor is None else scale * float(factor)


class GradientMonitor:
    """Sample gradient statistics every ``every`` steps; name the gradients that overflow.

    Args:
        optimizer: any ``torch.optim.Optimizer``; hooks go on it (``remove()`` takes them off).
        model: names parameters (``"encoder.layers.3.fc2.weight"``); without it, the
            optimizer's ``param_names`` (``torch.optim.X(model.named_parameters())``) or
            ``"param_groups[i][j]"``.
        every: sample at steps 1, every + 1, 2 * every + 1, ... (default 100).
        dtype: the low-precision dtype the fractions are for (default float16).
        name_overflows: keep references to the last step's gradients so that
            :meth:`nonfinite` can name the non-finite ones (no work per step).

    ``history`` holds every :class:`GradientSample` read so far; ``steps`` counts the
    optimizer steps seen (host-side).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        *,
        every: int = DEFAULT_EVERY,
        dtype: Any = torch.float16,
        name_overflows: bool = True,
    ) -> None:
        check_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        if model is not None:
            check_instance("model", model, nn.Module, "a torch.nn.Module or None")
        self.every = check_number("every", every, integer=True, minimum=1, hint="e.g. every=100")
        self.dtype = as_low_precision(dtype, "dtype")
        self.name_overflows = check_bool("name_overflows", name_overflows)
        self.optimizer, self.model = optimizer, model
        self.steps = 0
        self.history: list[GradientSample] = []
        self._pending: list[_Pending] = []
        self._names = _parameter_names(optimizer, model)
        self._watched_count = -1
        self._layout: list[tuple[torch.device, list[str], list[torch.Tensor]]] = []
        self._last: list[tuple[list[str], list[torch.Tensor]]] = []
        self._handles = [optimizer.register_step_pre_hook(self._before_step)]
        if model is not None and name_overflows:
            self._handles.append(model.register_forward_pre_hook(self._release_hook))

    def remove(self) -> None:
        """Take the hooks off (pending samples can still be read)."""
        for handle in self._handles:
            handle.remove()
        self.release()

    def release(self) -> None:
        """Drop the references to the last step's gradients (:meth:`nonfinite` then names none)."""
        self._last = []

    def _release_hook(self, module: nn.Module, args: Any) -> None:
        self._last = []

    @property
    def pending(self) -> int:
        """Samples taken on the device and not yet read (host-side count, no sync)."""
        return len(self._pending)

    # -- the hook: device work only ---------------------------------------------------

    def _gradients(self) -> list[tuple[torch.device, list[str], list[torch.Tensor]]]:
        """This step's gradients and their names, grouped by device and dtype.

        A gradient has its parameter's device and dtype, so the grouping is worked out
        once (again when the optimizer's parameters change) and a step only reads
        ``.grad``.
        """
        params = _watched(self.optimizer)
        if len(params) != self._watched_count:  # first step, or a param group was added
            self._names = _parameter_names(self.optimizer, self.model)
            layout: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
            for name, p in zip(self._names, params):
                names, members = layout.setdefault((p.device, p.dtype), ([], []))
                names.append(name)
                members.append(p)
            self._layout = [(device, n, m) for (device, _), (n, m) in layout.items()]
            self._watched_count = len(params)
        groups = []
        for device, names, members in self._layout:
            grads = [p.grad for p in members]
            if any(g is None for g in grads):
                kept = [(n, g) for n, g in zip(names, grads) if g is not None]
                names, grads = [n for n, _ in kept], [g for _, g in kept]
            if grads:
                groups.append((device, names, grads))
        return groups

    @torch.no_grad()
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        groups = self._gradients()
        if not groups:
            return
        if self.name_overflows:
            self._last = [(names, grads) for _, names, grads in groups]
        if (self.steps - 1) % self.every == 0:
            names, parts = [], []
            for device, group_names, grads in groups:
                counts = torch.zeros(len(grads), NUM_BINS, dtype=torch.int64, device=device)
                count_exponents_rows_(counts, grads, self.dtype)  # a few kernels per group
                names += group_names
                parts.append(counts.to(groups[0][0], non_blocking=True))
            scale = _gradient_scale(self.optimizer)
            counts = parts[0] if len(parts) == 1 else torch.cat(parts)
            self._pending.append(_Pending(self.steps, names, counts, scale))

    # -- reading: one host sync each ----------------------------------------------------

    def read_samples(self) -> list[GradientSample]:
        """Copy the pending samples to the host, append them to ``history``, return them."""
        new = []
        for p in self._pending:
            scale = 1.0 if p.scale is None else float(p.scale)
            rows = p.counts.cpu().numpy()
            new.append(GradientSample.from_rows(p.step, scale, self.dtype, p.names, rows))
        self._pending = []
        self.history.extend(new)
        return new

    def nonfinite(self) -> list[str]:
        """Names of the gradients that held inf/NaN at the last step (one host sync per
        device and dtype); ``[]`` once :meth:`release` has run."""
        names = []
        with torch.no_grad():
            for group_names, grads in self._last:
                # The L2 norm is inf/nan exactly when the gradient holds an inf/nan (barring
                # finite values beyond 1e19); float16 norms are taken in float32 so that
                # they cannot overflow.
                wide = {"dtype": torch.float32} if grads[0].dtype == torch.float16 else {}
                norms = torch.stack(torch._foreach_norm(grads, 2.0, **wide)).tolist()
                names += [n for n, norm in zip(group_names, norms) if not math.isfinite(norm)]
        return names
