"""``PrecisionReport``: what a low-precision dtype does to every layer, and what to do about it.

Built from per-layer exponent histograms (:func:`mixprec.diagnose` collects them),
the report works out, for the target dtype:

* per layer (``report.layers``): the fraction of values that underflow or overflow
  without loss scaling, and the exponent range in use;
* the range of loss scales that keeps the gradients representable, and the
  recommended scale in it with the margin it leaves (:mod:`.scales`);
* the layers at risk under any single scale (``report.at_risk``, with
  ``report.reasons``): activations or values that overflow, or of which more than
  the tolerance become zero (a scale cannot move them); gradients wider than the
  dtype; gradients outside the range the others share. Each problem is pinned on the
  innermost module that shows it (a container's output is its last child's). These
  are the candidates for float32; :meth:`PrecisionReport.suggest`
  turns the report into settings.

``str(report)`` is a table, :meth:`PrecisionReport.save` writes
``precision_report.json`` and ``precision_report.png``, :meth:`PrecisionReport.load`
reads the JSON back into an equal report.

>>> from mixprec.diagnostics._histogram import ExponentCounts
>>> from mixprec.diagnostics._layers import LayerStats
>>> g = lambda exps: ExponentCounts(exps, 0, 0, sum(exps.values()))
>>> report = PrecisionReport([
...     LayerStats("a.weight", "parameter", torch.float16, {"grad": g({-20: 9, -8: 1})}),
...     LayerStats("b", "module", torch.float16, {"activation": g({17: 1, 0: 3})}),
... ], torch.float16)
>>> report.recommended_loss_scale, report.loss_scale_range, report.at_risk
(1024.0, (64.0, 8388608.0), ('b',))
>>> report.layers["a.weight"].underflow_fraction
0.9
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mixprec._checks import as_dtype, check_instance, check_number
from mixprec.diagnostics._analysis import analyse, percent, power, scale_free_reason
from mixprec.diagnostics._histogram import ExponentCounts
from mixprec.diagnostics._layers import GRADIENTS, LayerStats
from mixprec.diagnostics._scales import ScaleChoice

REPORT_JSON = "precision_report.json"
REPORT_PNG = "precision_report.png"


class PrecisionReport:
    """Per-layer range statistics for ``dtype``, the loss scale to use, the layers at risk.

    Args:
        layers: :class:`LayerStats` (or a mapping of name to them), in model order.
        dtype: the target low-precision dtype.
        tolerance: the fraction of a tensor's values allowed to underflow (default 1 %).
        margin_bits: the recommendation keeps the gradients this many doublings away
            from overflow and halvings away from the tolerance, where the range allows.
        horizon_bits: when choosing the scale, a gradient's values more than
            ``2**horizon_bits`` below its largest value do not count as underflowing
            (default 24): every sum they enter (a matmul's float32 accumulation, an
            optimizer's update) rounds them away next to that value anyway, so keeping
            them representable would only squeeze the range (a saturated softmax
            gives cross-entropy gradients of 1e-30; a key bias gets none but rounding
            noise). ``None`` counts every value. The table's fractions always count all.
        batches: how many batches the statistics came from (shown in the table).
        inputs: the histogram of the model's floating inputs, if recorded: inputs that
            overflow (or vanish in) the dtype are a data problem no layer setting fixes,
            reported in ``notes``.
        float8: per float8 layer, :func:`mixprec.float8.read_float8_stats`'s numbers
            (amax, scale, saturated fraction and overflows of its input, weight and
            gradient casts), shown under the summary; ``None`` for none.

    Attributes: ``layers``, ``recommended_loss_scale`` (a float; 1.0 when no gradient
    fits any scale), ``loss_scale_range`` (``(low, high)`` or ``None``), ``margin``
    (``(bits below, bits above)`` or ``None``), ``at_risk`` (names, model order),
    ``reasons`` (name -> why it is at risk), ``risky_tensors`` (the ``(name, tensor)``
    pairs behind them), ``notes`` (problems no layer setting fixes). How the layers at
    risk and the scale are decided: :mod:`mixprec.diagnostics._analysis`.
    """

    def __init__(
        self,
        layers: Iterable[LayerStats] | Mapping[str, LayerStats],
        dtype: Any = torch.float16,
        *,
        tolerance: float = 0.01,
        margin_bits: int = 4,
        horizon_bits: int | None = 24,
        batches: int = 0,
        inputs: ExponentCounts | None = None,
        float8: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        self.dtype = as_dtype(dtype)
        self.tolerance = check_number("tolerance", tolerance, minimum=0, maximum=1)
        self.margin_bits = check_number("margin_bits", margin_bits, integer=True, minimum=0)
        self.horizon_bits = check_number(
            "horizon_bits", horizon_bits, integer=True, minimum=1, allow_none=True
        )
        self.batches = check_number("batches", batches, integer=True, minimum=0)
        entries = list(layers.values()) if isinstance(layers, Mapping) else list(layers)
        for i, layer in enumerate(entries):
            check_instance(f"layers[{i}]", layer, LayerStats, "a LayerStats")
            if layer.dtype != self.dtype:
                raise ValueError(
                    f"layers[{i}] ({layer.name!r}) is for {layer.dtype}, the report for {self.dtype}"
                )
        self.layers: dict[str, LayerStats] = {layer.name: layer for layer in entries}
        if len(self.layers) != len(entries):
            raise ValueError("layers must have distinct names")
        if inputs is not None:
            check_instance("inputs", inputs, ExponentCounts, "an ExponentCounts or None")
        self.inputs = inputs
        if float8 is not None:
            check_instance("float8", float8, Mapping, "a mapping layer -> statistics, or None")
        self.float8 = None if float8 is None else {k: dict(v) for k, v in float8.items()}
        self.notes: list[str] = []
        if inputs is not None and (
            reason := scale_free_reason("input", inputs, self.dtype, self.tolerance)
        ):
            self.notes.append(
                f"model inputs: {reason.replace('of its inputs', 'of them')}; amp levels "
                "cast inputs to the low dtype on entry, so rescale or normalise the data "
                "(no layer setting fixes this)"
            )
        found = analyse(
            self.layers,
            self.dtype,
            tolerance=self.tolerance,
            margin_bits=self.margin_bits,
            horizon_bits=self.horizon_bits,
        )
        self._choice: ScaleChoice | None = found.choice
        self.reasons: dict[str, tuple[str, ...]] = dict(found.reasons)
        self.at_risk: tuple[str, ...] = tuple(found.reasons)
        self.risky_tensors: frozenset[tuple[str, str]] = found.risky

    @property
    def recommended_loss_scale(self) -> float:
        """The loss scale to train with (1.0 if no gradient is representable at any scale)."""
        return 1.0 if self._choice is None else self._choice.scale

    @property
    def loss_scale_range(self) -> tuple[float, float] | None:
        """``(low, high)``: every scale in it keeps the gradients not at risk representable."""
        if self._choice is None:
            return None
        return 2.0**self._choice.lo, 2.0**self._choice.hi

    @property
    def margin(self) -> tuple[int, int] | None:
        """``(below, above)``: how many halvings / doublings of the gradients the
        recommended scale absorbs before they underflow (beyond tolerance) / overflow."""
        return None if self._choice is None else self._choice.margin_bits

    def underflowing(self, scale: float = 1.0) -> list[str]:
        """Layers with more than ``tolerance`` of a tensor underflowing at ``scale``."""
        return [n for n, layer in self.layers.items() if layer.underflow_at(scale) > self.tolerance]

    def overflowing(self, scale: float = 1.0) -> list[str]:
        """Layers with any value overflowing (or already non-finite) at ``scale``."""
        return [n for n, layer in self.layers.items() if layer.overflow_at(scale) > 0]

    def suggest(self):  # -> Suggestion (imported late: suggest builds on this module)
        """Settings that follow this report: see :class:`~mixprec.diagnostics.Suggestion`."""
        from mixprec.diagnostics._suggest import Suggestion

        return Suggestion.from_report(self)

    # -- output -----------------------------------------------------------------------

    def summary_lines(self) -> list[str]:
        """The lines above the table: the dtype, the scale, the layers at risk."""
        name_of = str(self.dtype).replace("torch.", "")
        lines = [
            f"precision report for {self.dtype}: {len(self.layers)} layers from {self.batches} "
            f"batch(es); a tensor may underflow by {percent(self.tolerance)}"
        ]
        if self._choice is None:
            lines.append("loss scale: no scale keeps any gradient representable")
        else:
            c = self._choice
            below, above = c.margin_bits
            lines.append(
                f"loss scale: recommended {power(c.exponent)} = {c.scale:g}; range "
                f"{power(c.lo)}..{power(c.hi)}; margin {below} bits below, {above} above"
            )
        lines += [f"warning: {note}" for note in self.notes]
        if self.float8:
            # Imported here: mixprec.float8 loads only for a report that has float8 layers.
            from mixprec.float8._stats import TENSORS as FLOAT8_TENSORS

            for name, s in self.float8.items():
                lines.append(
                    f"float8 layer {name}: amax input {s['amax_input']:.3g}, weight "
                    f"{s['amax_weight']:.3g}, gradient {s['amax_grad']:.3g}; saturated "
                    + ", ".join(percent(s[f"saturated_fraction_{t}"]) for t in FLOAT8_TENSORS)
                    + " (input, weight, gradient)"
                )
        if not self.at_risk:
            lines.append(f"at risk under any single scale: none (everything fits {name_of})")
        else:
            lines.append("at risk under any single scale (keep in float32):")
            for name in self.at_risk:
                lines.append(f"  {name}: {'; '.join(self.reasons[name])}")
        lines += self._not_at_risk_lines()
        return lines

    def _not_at_risk_lines(self) -> list[str]:
        """Why tensors whose ``under`` column (at the recommended scale) passes the
        tolerance are not at risk: so a large number beside "none" reads as it should."""
        scale, name_of = self.recommended_loss_scale, str(self.dtype).replace("torch.", "")
        subnormal: list[str] = []
        far: list[str] = []
        for name, layer in self.layers.items():
            for tensor, counts in layer.tensors.items():
                gradient = tensor in GRADIENTS
                under = counts.underflow_fraction(self.dtype, scale if gradient else 1.0)
                if under <= self.tolerance or (name, tensor) in self.risky_tensors:
                    continue
                (far if gradient else subnormal).append(f"{name} {tensor} {percent(under)}")
        lines = []
        if subnormal:
            lines.append(
                f"not at risk, though over {percent(self.tolerance)} under: "
                f"{', '.join(subnormal)}: subnormal in {name_of}, not zero (fewer bits of "
                "precision, no value lost; at risk is more than the tolerance becoming zero)"
            )
        if far:
            why = (
                "subnormal at the recommended scale, not zero"
                if self.horizon_bits is None
                else f"values more than 2^{self.horizon_bits} below their tensor's largest, "
                "which the sums they enter round away anyway"
            )
            lines.append(
                f"not at risk, though over {percent(self.tolerance)} under at the scale: "
                f"{', '.join(far)}: {why}"
            )
        return lines

    def table_rows(self) -> list[list[str]]:
        """One row per layer and tensor: the cells of :meth:`__str__`'s table."""
        scale = self.recommended_loss_scale
        rows = []
        for name, layer in self.layers.items():
            for tensor, counts in layer.tensors.items():
                span = counts.exponent_range()
                at = scale if tensor in GRADIENTS else 1.0
                rows.append(
                    [
                        name,
                        tensor,
                        "-" if span is None else f"{span[0]}..{span[1]}",
                        percent(counts.zero_fraction()),
                        percent(counts.underflow_fraction(self.dtype)),
                        percent(counts.overflow_fraction(self.dtype)),
                        percent(counts.underflow_fraction(self.dtype, at)),
                        percent(counts.overflow_fraction(self.dtype, at)),
                        "AT RISK" if (name, tensor) in self.risky_tensors else "",
                    ]
                )
        return rows

    def __str__(self) -> str:
        scale = power(math.log2(self.recommended_loss_scale))
        header = ["layer", "tensor", "exponents", "zero", "under", "over",
                  f"under@{scale}", f"over@{scale}", "risk"]  # fmt: skip
        rows = self.table_rows()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        align = ["<", "<", ">", ">", ">", ">", ">", ">", "<"]

        def line(cells: list[str]) -> str:
            return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()

        table = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
        return "\n".join([*self.summary_lines(), "", *table])

    def __repr__(self) -> str:
        return (
            f"PrecisionReport({len(self.layers)} layers, {self.dtype}, recommended loss scale "
            f"{self.recommended_loss_scale:g}, at risk {list(self.at_risk)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything in the report as JSON-ready data; :meth:`from_dict` rebuilds it."""
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "tolerance": self.tolerance,
            "margin_bits": self.margin_bits,
            "horizon_bits": self.horizon_bits,
            "batches": self.batches,
            "recommended_loss_scale": self.recommended_loss_scale,
            "loss_scale_range": list(self.loss_scale_range) if self.loss_scale_range else None,
            "margin": list(self.margin) if self.margin else None,
            "at_risk": {name: list(self.reasons[name]) for name in self.at_risk},
            "notes": list(self.notes),
            "inputs": None if self.inputs is None else self.inputs.to_dict(),
            "layers": {name: layer.to_dict() for name, layer in self.layers.items()},
            "float8": self.float8,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionReport:
        """Rebuild a report from :meth:`to_dict`'s output (the analysis is recomputed)."""
        check_instance("data", data, Mapping, "a dict from PrecisionReport.to_dict()")
        try:
            dtype = as_dtype(data["dtype"])
            layers = [LayerStats.from_dict(n, d, dtype) for n, d in data["layers"].items()]
            return cls(
                layers,
                dtype,
                tolerance=data["tolerance"],
                margin_bits=data["margin_bits"],
                horizon_bits=data["horizon_bits"],
                batches=data["batches"],
                inputs=None
                if data.get("inputs") is None
                else ExponentCounts.from_dict(data["inputs"]),
                float8=data.get("float8"),
            )
        except KeyError as err:
            raise ValueError(f"not a precision report: missing key {err}") from None

    def save(self, folder: str | Path) -> tuple[Path, Path]:
        """Write ``precision_report.json`` and ``precision_report.png`` into ``folder``."""
        from mixprec.diagnostics._plot import plot_report

        check_instance("folder", folder, (str, Path), "a str or Path")
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"folder {str(folder)!r} is a file, not a folder; choose another path")
        folder.mkdir(parents=True, exist_ok=True)
        json_path, png_path = folder / REPORT_JSON, folder / REPORT_PNG
        json_path.write_text(json.dumps(self.to_dict(), indent=1))
        plot_report(self, png_path)
        return json_path, png_path

    @classmethod
    def load(cls, path: str | Path) -> PrecisionReport:
        """Read a report saved by :meth:`save` (the JSON file, or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / REPORT_JSON
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a precision report (bad JSON: {err})") from None
        return cls.from_dict(data)
