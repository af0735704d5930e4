"""``Suggestion``: a precision report turned into settings for training.

``report.suggest()`` proposes

* a loss scale: a dynamic scale that *starts* at the recommended value, so the
  first steps neither overflow (as a 2**15 start does for large gradients) nor waste
  range (float16 only: bfloat16 gets no scaling when 1 is recommended);
* a deny list: the modules to keep in float32, the innermost module owning each
  layer at risk (a parameter's module, or the module itself).

Use it with :func:`mixprec.amp.initialize` or :class:`mixprec.LossScaleOptimizer`::

    s = report.suggest()
    for name in s.float32_modules:                       # before amp.initialize
        amp.to_float(model.get_submodule(name), torch.float32)
    model, opt = amp.initialize(model, opt, "O2", torch.float16, **s.kwargs)
    # or: opt = LossScaleOptimizer(opt, **s.kwargs)

>>> from mixprec.diagnostics._histogram import ExponentCounts
>>> from mixprec.diagnostics._layers import LayerStats
>>> from mixprec.diagnostics._report import PrecisionReport
>>> g = lambda exps: ExponentCounts(exps, 0, 0, sum(exps.values()))
>>> report = PrecisionReport([
...     LayerStats("fc.weight", "parameter", torch.float16, {"grad": g({-20: 9, -8: 1})}),
...     LayerStats("head.proj", "module", torch.float16, {"activation": g({17: 1, 0: 3})}),
...     LayerStats("head.proj.weight", "parameter", torch.float16, {"grad": g({-40: 1})}),
... ], torch.float16)
>>> s = report.suggest()
>>> s.loss_scale, s.float32_modules
(1024.0, ('head.proj',))
>>> s.kwargs["loss_scale"]
DynamicLossScale(initial_scale=1024.0, ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.diagnostics._layers import LayerStats
from mixprec.loss_scale import DynamicLossScale

# DynamicLossScale's own bounds; a recommendation outside them widens them.
_DEFAULT_MIN_SCALE, _DEFAULT_MAX_SCALE = 1.0, 2.0**24


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """Settings derived from a :class:`~mixprec.diagnostics.PrecisionReport`.

    ``loss_scale``: the recommended starting scale; ``float32_modules``: module names
    (``model.get_submodule(name)``) to keep in float32, innermost first in model
    order; ``reasons``: for each, why; ``whole_model``: True when a parameter of the
    root module itself is at risk (no submodule to deny: train that model in float32);
    ``notes``: problems no setting here fixes (inputs out of range).
    """

    dtype: torch.dtype
    loss_scale: float
    float32_modules: tuple[str, ...]
    reasons: Mapping[str, tuple[str, ...]]
    whole_model: bool = False
    notes: tuple[str, ...] = ()

    @classmethod
    def from_report(cls, report: Any) -> Suggestion:
        modules: dict[str, list[str]] = {}
        whole_model = False
        for name in report.at_risk:
            layer: LayerStats = report.layers[name]
            owner = name.rpartition(".")[0] if layer.kind == "parameter" else name
            if layer.kind == "parameter" and "." not in name:
                whole_model = True
                continue
            modules.setdefault(owner, []).extend(f"{name}: {r}" for r in report.reasons[name])
        return cls(
            report.dtype,
            report.recommended_loss_scale,
            tuple(modules),
            {m: tuple(r) for m, r in modules.items()},
            whole_model,
            tuple(report.notes),
        )

    @property
    def kwargs(self) -> dict[str, Any]:
        """``{"loss_scale": ...}`` for ``amp.initialize`` or ``LossScaleOptimizer`` (a fresh
        :class:`~mixprec.DynamicLossScale` starting at :attr:`loss_scale` on each access;
        ``"none"`` for bfloat16 when no scaling is needed)."""
        if self.dtype == torch.bfloat16 and self.loss_scale == 1.0:
            return {"loss_scale": "none"}
        return {
            "loss_scale": DynamicLossScale(
                initial_scale=self.loss_scale,
                min_scale=min(_DEFAULT_MIN_SCALE, self.loss_scale),
                max_scale=max(_DEFAULT_MAX_SCALE, self.loss_scale),
            )
        }

    def __str__(self) -> str:
        lines = [f"warning: {note}" for note in self.notes]
        lines.append(f"loss scale: start at {self.loss_scale:g}")
        if self.whole_model:
            lines.append("a parameter of the model itself is at risk: train it in float32")
        if self.float32_modules:
            lines.append("keep in float32: " + ", ".join(self.float32_modules))
        else:
            lines.append("keep in float32: nothing")
        return "\n".join(lines)
