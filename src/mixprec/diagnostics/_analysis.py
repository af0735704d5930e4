"""Which layers are at risk in a dtype, and the one loss scale for the rest.

:func:`analyse` reads per-layer histograms (:class:`~.layers.LayerStats`) and decides::

    found <- values and activations that overflow, or of which more than the
             tolerance become zero (no scale moves them), innermost module each
    float32 <- the modules those name (a parameter: its module)
    repeat:
        intervals <- each gradient's scale interval, except inside float32 modules
        choice <- choose_scale(intervals)                     # see .scales
        misfits <- gradients wider than the dtype, or left out by the choice
        float32 += their modules          # float32 gradients constrain no scale
    until float32 stops growing

so the deny list and the scale fit together: the scale is chosen for the gradients
that stay in the low dtype once the layers at risk are float32. A module's output is
also its container's, so each problem is pinned on the innermost module showing it.

>>> from mixprec.diagnostics._histogram import ExponentCounts
>>> from mixprec.diagnostics._layers import LayerStats
>>> g = lambda exps: ExponentCounts(exps, 0, 0, sum(exps.values()))
>>> layers = {"fc": LayerStats("fc", "module", torch.float16, {"activation": g({16: 1})})}
>>> result = analyse(layers, torch.float16, tolerance=0.01, margin_bits=4, horizon_bits=24)
>>> result.reasons, result.choice
({'fc': ('100.00% of its activations overflow float16 (up to 2^16)',)}, None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from mixprec.diagnostics._histogram import ExponentCounts
from mixprec.diagnostics._layers import GRADIENTS, LayerStats
from mixprec.diagnostics._scales import K_MAX, K_MIN, ScaleChoice, choose_scale

_WHAT = {
    "input": "inputs",
    "value": "values",
    "grad": "gradient",
    "activation": "activations",
    "activation_grad": "activation gradient",
}


def percent(fraction: float) -> str:
    """``0``, ``3.12%`` or ``5e-03%``: a fraction for a table."""
    if fraction == 0:
        return "0"
    return f"{100 * fraction:.2f}%" if fraction >= 1e-4 else f"{100 * fraction:.0e}%"


def power(k: float) -> str:
    """``2^k``."""
    return f"2^{int(k)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_inside(child: str, parent: str) -> bool:
    return child.startswith(parent + ".")


def _innermost(found: dict[str, dict[str, str]]) -> None:
    """Blank a module's reason when a module inside it has one for the same tensor kind:
    a container's output is also its last child's, so the child is the one at fault."""
    for name, reasons in found.items():
        for other, other_reasons in found.items():
            if _is_inside(other, name):
                for tensor in set(reasons) & {t for t, r in other_reasons.items() if r}:
                    reasons[tensor] = ""


def scale_free_reason(
    tensor: str, counts: ExponentCounts, dtype: torch.dtype, tolerance: float
) -> str:
    """Why values, activations or inputs (which no scale moves) are at risk, or ``""``."""
    # Subnormal values keep some precision: what counts is overflow, or values lost to 0.
    what = _WHAT[tensor]
    over, lost = counts.overflow_fraction(dtype), counts.flush_fraction(dtype)
    if over > 0:
        top = counts.exponent_range()
        upto = f" (up to {power(top[1])})" if top else ""
        return f"{percent(over)} of its {what} overflow {_dtype_name(dtype)}{upto}"
    if lost > tolerance:
        return f"{percent(lost)} of its {what} become zero in {_dtype_name(dtype)}"
    return ""


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What :func:`analyse` found: the scale ``choice`` (``None`` if no gradient fits any
    scale), ``reasons`` per layer at risk (model order), the ``(name, tensor)`` pairs
    behind them (``risky``)."""

    choice: ScaleChoice | None
    reasons: Mapping[str, tuple[str, ...]]
    risky: frozenset[tuple[str, str]]


def _owner(layers: Mapping[str, LayerStats], name: str) -> str:
    """The module a float32 setting goes on: a parameter's module, or the module."""
    return name.rpartition(".")[0] if layers[name].kind == "parameter" else name


def _in_float32(layers: Mapping[str, LayerStats], name: str, float32: set[str]) -> bool:
    """Whether ``name``'s gradient is computed in float32 once ``float32`` modules are:
    their parameters and everything inside them, not their own outputs' gradients
    (a low-precision consumer still hands those back in the low dtype)."""
    owner = _owner(layers, name)
    return any(_is_inside(owner, m) or (owner == m != name) for m in float32)


def analyse(
    layers: Mapping[str, LayerStats],
    dtype: torch.dtype,
    *,
    tolerance: float,
    margin_bits: int,
    horizon_bits: int | None,
) -> Analysis:
    """Find the layers at risk in ``dtype`` and the loss scale for the others (see above)."""
    found: dict[str, dict[str, str]] = {}  # name -> {tensor: reason}
    for name, layer in layers.items():
        for tensor, counts in layer.tensors.items():
            if tensor not in GRADIENTS and (
                reason := scale_free_reason(tensor, counts, dtype, tolerance)
            ):
                found.setdefault(name, {})[tensor] = reason
    _innermost(found)
    float32 = {_owner(layers, n) for n in found} - {""}
    misfits: dict[str, str] = {}  # gradient -> why no shared scale serves it
    needs: dict[str, tuple[float, float]] = {}
    while True:
        intervals: dict[str, tuple[float, float]] = {}
        for name, layer in layers.items():
            tensor = layer.gradient_name
            if tensor is None or name in misfits or _in_float32(layers, name, float32):
                continue
            counts = layer.tensors[tensor]
            lo, hi = counts.scale_interval(dtype, tolerance, horizon_bits)
            if counts.nonfinite:
                found.setdefault(name, {})[tensor] = f"its {_WHAT[tensor]} holds inf/nan"
            elif lo > hi:
                span = counts.exponent_range()
                misfits[name] = (
                    f"spans {power(span[0])}..{power(span[1])}, wider than "
                    f"{_dtype_name(dtype)} holds at any scale"
                )
            else:
                intervals[name] = (lo, hi)
        choice = choose_scale(intervals, margin_bits)
        for name in () if choice is None else choice.excluded:
            misfits[name], needs[name] = "", intervals[name]
        grown = float32 | ({_owner(layers, n) for n in misfits} - {""})
        if grown == float32:
            break
        float32 = grown
    shared = "none" if choice is None else f"{power(choice.lo)}..{power(choice.hi)}"
    for name, (lo, hi) in needs.items():
        need = f"{power(max(lo, K_MIN))}..{power(min(hi, K_MAX))}"
        misfits[name] = f"needs a scale in {need}, outside the range the others share ({shared})"
    scale = 1.0 if choice is None else choice.scale
    for name, text in misfits.items():
        tensor = layers[name].gradient_name
        counts = layers[name].tensors[tensor]
        under = counts.underflow_fraction(dtype, scale)
        over = counts.overflow_fraction(dtype, scale)
        found.setdefault(name, {})[tensor] = (
            f"its {_WHAT[tensor]} {text}; at {scale:g}: {percent(under)} underflow, "
            f"{percent(over)} overflow"
        )
    _innermost(found)
    reasons = {}
    for name in layers:
        texts = tuple(r for r in found.get(name, {}).values() if r)
        if texts:
            reasons[name] = texts
    risky = frozenset((n, t) for n, rs in found.items() for t, r in rs.items() if r)
    return Analysis(choice, reasons, risky)
