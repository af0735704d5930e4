"""Choosing one loss scale for many gradients, and the gradients no scale can serve.

Each gradient (of a parameter, or flowing into a module's output) has an interval
of scale exponents ``[lo, hi]`` that keeps it representable
(:meth:`~mixprec.diagnostics._histogram.ExponentCounts.scale_interval`). One loss
scale multiplies them all, so the recommendation is an exponent inside as many of
those intervals as possible::

    for k in K_MIN..K_MAX:  covered(k) = {gradients with lo <= k <= hi}
    best = the largest covered(k); runs = maximal stretches of k with that same set
    for each run [lo, hi]:   k = clamp(0, lo + margin, hi - margin)   # nearest 1 with margin
                             (the midpoint when the run is narrower than 2 * margin)
    keep the run whose k leaves the most margin on its tighter side
    every gradient outside the kept set is at risk under any single scale

Preferring the scale nearest 1 keeps scales no larger than they need to be (a
bfloat16 model gets 1), and ``margin`` bits of room on both sides let gradients grow
or shrink by ``2**margin`` before they overflow or underflow.

>>> choice = choose_scale({"a": (3, 20), "b": (5, 25), "c": (30, 40)}, margin_bits=4)
>>> choice.exponent, (choice.lo, choice.hi), choice.excluded
(9, (5, 20), ('c',))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: The loss-scale exponents considered: 2**-64 to 2**64.
K_MIN, K_MAX = -64, 64


@dataclasses.dataclass(frozen=True)
class ScaleChoice:
    """A recommended scale ``2**exponent``, the range ``[2**lo, 2**hi]`` it sits in, and
    the gradients (``excluded``) that range does not keep representable."""

    exponent: int
    lo: int
    hi: int
    excluded: tuple[str, ...]

    @property
    def scale(self) -> float:
        return 2.0**self.exponent

    @property
    def margin_bits(self) -> tuple[int, int]:
        """``(below, above)``: how many halvings / doublings of the gradients stay in range."""
        return self.exponent - self.lo, self.hi - self.exponent


def _clip(value: float) -> int:
    return int(min(max(value, K_MIN), K_MAX))


def _pick(lo: int, hi: int, margin_bits: int) -> int:
    if hi - lo < 2 * margin_bits:
        return (lo + hi) // 2
    return min(max(0, lo + margin_bits), hi - margin_bits)


def choose_scale(
    intervals: Mapping[str, tuple[float, float]], margin_bits: int = 4
) -> ScaleChoice | None:
    """The scale keeping the most gradients representable (``None`` if it keeps none).

    ``intervals`` maps each gradient's name to its ``(lo, hi)`` scale exponents
    (``±inf`` for no bound). Ties between equally covering ranges go to the one with
    the most margin, then to the scale nearest 1.
    """
    names = list(intervals)
    clipped = {n: (_clip(lo), _clip(hi)) for n, (lo, hi) in intervals.items() if lo <= hi}
    covered = [
        frozenset(n for n, (lo, hi) in clipped.items() if lo <= k <= hi)
        for k in range(K_MIN, K_MAX + 1)
    ]
    best = max((len(s) for s in covered), default=0)
    if best == 0:
        return None
    runs: list[tuple[int, int, frozenset]] = []
    for offset, members in enumerate(covered):
        k = K_MIN + offset
        if len(members) != best:
            continue
        if runs and runs[-1][2] == members and runs[-1][1] == k - 1:
            runs[-1] = (runs[-1][0], k, members)
        else:
            runs.append((k, k, members))

    def quality(run: tuple[int, int, frozenset]) -> tuple[int, float]:
        k = _pick(run[0], run[1], margin_bits)
        return (min(k - run[0], run[1] - k), -abs(k))

    lo, hi, members = max(runs, key=quality)
    excluded = tuple(n for n in names if n not in members)
    return ScaleChoice(_pick(lo, hi, margin_bits), lo, hi, excluded)
