"""One layer's statistics: the exponent histograms of its values and gradients.

A *parameter* (``"fc2.weight"``) has the histograms ``"value"`` and ``"grad"``; a
*module* (``"fc2"``) has ``"activation"`` (its outputs) and ``"activation_grad"``
(the gradients flowing back into those outputs). Gradients are the tensors a loss
scale multiplies; values and activations it leaves alone.

>>> from mixprec.diagnostics._histogram import ExponentCounts
>>> grad = ExponentCounts({-30: 3, -2: 1}, zeros=0, nonfinite=0, total=4)
>>> value = ExponentCounts({-3: 4}, zeros=0, nonfinite=0, total=4)
>>> layer = LayerStats("fc.weight", "parameter", torch.float16, {"value": value, "grad": grad})
>>> layer.underflow_fraction, layer.overflow_fraction, layer.exponent_range, layer.worst_tensor
(0.75, 0.0, (-30, -2), 'grad')
>>> layer.underflow_at(2.0**16), layer.overflow_at(2.0**16)
(0.0, 0.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.diagnostics._histogram import ExponentCounts

#: The histograms each kind of entry holds.
TENSORS: dict[str, tuple[str, str]] = {
    "parameter": ("value", "grad"),
    "module": ("activation", "activation_grad"),
}
KINDS = tuple(TENSORS)
#: The histograms a loss scale multiplies.
GRADIENTS = ("grad", "activation_grad")


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Statistics of one parameter or module for a target ``dtype``.

    ``underflow_fraction`` / ``overflow_fraction`` are those of its worst histogram
    (``worst_tensor``) without loss scaling: the fraction of values that become
    subnormal or zero / inf in ``dtype``. ``exponent_range`` spans all its histograms.
    :meth:`underflow_at` and :meth:`overflow_at` apply a loss scale to the gradients.
    """

    name: str
    kind: str
    dtype: torch.dtype
    tensors: Mapping[str, ExponentCounts]

    def __post_init__(self) -> None:
        if self.kind not in TENSORS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        unknown = set(self.tensors) - set(TENSORS[self.kind])
        if unknown:
            raise ValueError(
                f"a {self.kind} has histograms {TENSORS[self.kind]}, got {sorted(unknown)}"
            )

    def _scale_of(self, tensor: str, scale: float) -> float:
        return scale if tensor in GRADIENTS else 1.0

    def underflow_at(self, scale: float) -> float:
        """The worst underflow fraction with gradients multiplied by ``scale``."""
        return max(
            (
                c.underflow_fraction(self.dtype, self._scale_of(t, scale))
                for t, c in self.tensors.items()
            ),
            default=0.0,
        )

    def overflow_at(self, scale: float) -> float:
        """The worst overflow fraction with gradients multiplied by ``scale``."""
        return max(
            (
                c.overflow_fraction(self.dtype, self._scale_of(t, scale))
                for t, c in self.tensors.items()
            ),
            default=0.0,
        )

    @property
    def underflow_fraction(self) -> float:
        return self.underflow_at(1.0)

    @property
    def overflow_fraction(self) -> float:
        return self.overflow_at(1.0)

    @property
    def worst_tensor(self) -> str | None:
        """The histogram with the most values out of range (overflow first), or ``None``."""
        if not self.tensors:
            return None
        return max(
            self.tensors,
            key=lambda t: (
                self.tensors[t].overflow_fraction(self.dtype),
                self.tensors[t].underflow_fraction(self.dtype),
            ),
        )

    @property
    def exponent_range(self) -> tuple[int, int] | None:
        """``(smallest, largest)`` exponent of its nonzero finite values, or ``None``."""
        ranges = [r for c in self.tensors.values() if (r := c.exponent_range()) is not None]
        if not ranges:
            return None
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    @property
    def gradient_name(self) -> str | None:
        """``"grad"`` or ``"activation_grad"``: the histogram a loss scale multiplies, if held."""
        return next((t for t in GRADIENTS if t in self.tensors), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "underflow_fraction": self.underflow_fraction,
            "overflow_fraction": self.overflow_fraction,
            "exponent_range": list(self.exponent_range) if self.exponent_range else None,
            "tensors": {
                t: {
                    **c.to_dict(),
                    "underflow_fraction": c.underflow_fraction(self.dtype),
                    "overflow_fraction": c.overflow_fraction(self.dtype),
                    "zero_fraction": c.zero_fraction(),
                }
                for t, c in self.tensors.items()
            },
        }

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any], dtype: torch.dtype) -> LayerStats:
        try:
            kind, tensors = data["kind"], data["tensors"]
            return cls(
                name, kind, dtype, {t: ExponentCounts.from_dict(c) for t, c in tensors.items()}
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"layer {name!r}: not a layer entry ({err!r})") from None
