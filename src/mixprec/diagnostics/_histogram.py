"""Exponent histograms: how many values of a tensor sit at each power of two.

A value's *exponent* is ``floor(log2(|x|))``. Whether a value survives a cast to a
low-precision dtype, multiplied by a loss scale ``2**k``, depends only on that
exponent: it underflows (becomes subnormal, or zero) below the dtype's smallest
normal exponent and overflows above its largest. So one histogram of exponents per
tensor answers every "what if" about dtypes and scales, in bounded memory (257
counters, whatever the tensor's size) and without keeping a copy of the values.

Two halves:

* :class:`ExponentHistogram` accumulates counts **on the tensors' device**: reading
  the float32 bit pattern, shifting out the exponent field and one ``index_add_``.
  Nothing in :meth:`ExponentHistogram.add` reads a value back to the host.
* :class:`ExponentCounts` is the host-side result (:meth:`ExponentHistogram.read`,
  one device-to-host copy): fractions that underflow or overflow a dtype at a scale,
  the exponent range in use, and the range of loss scales that keeps them representable.

>>> h = ExponentHistogram(dtype=torch.float16)
>>> h.add(torch.tensor([0.0, 2.0**-20, 0.75, 3.0, 1e5]))
>>> c = h.read()
>>> c.total, c.zeros, c.exponent_range()
(5, 1, (-20, 16))
>>> c.underflow_fraction(torch.float16), c.overflow_fraction(torch.float16)
(0.2, 0.2)
>>> c.underflow_fraction(torch.float16, scale=2.0**8), c.overflow_fraction(torch.float16, 2.0**-2)
(0.0, 0.0)

Exactness: built with the target dtype (``ExponentHistogram(dtype=...)``), values are
rounded to its precision before binning, so overflow and the normal-range boundary
are exact counts at every power-of-two scale; whether a value just above half the
smallest subnormal becomes zero may be off by one rounding step. Scales that are not
powers of two are rounded down to one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec._checks import as_dtype

#: float32 biased exponents 0..255 (0: nonzero below 2**-126, 255: inf/nan), then exact zeros.
NUM_BINS = 257
_ZEROS = 256
_BIAS = 127
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class DtypeRange:
    """The exponents a floating dtype represents.

    ``min_normal``: the smallest normal exponent (float16: -14); ``max``: the
    largest finite exponent (float16: 15); ``min_subnormal``: the smallest
    subnormal exponent (float16: -24). Values below ``2**min_normal`` lose
    precision (subnormal) and below ``2**(min_subnormal - 1)`` become zero.

    >>> dtype_range(torch.float16)
    DtypeRange(dtype=torch.float16, min_normal=-14, max=15, min_subnormal=-24)
    >>> dtype_range("bf16").min_normal
    -126
    """

    dtype: torch.dtype
    min_normal: int
    max: int
    min_subnormal: int


def dtype_range(dtype: Any) -> DtypeRange:
    """The :class:`DtypeRange` of a floating dtype (a ``torch.dtype`` or a name)."""
    dtype = as_dtype(dtype)
    info = torch.finfo(dtype)
    min_normal = int(math.log2(info.smallest_normal))
    mantissa_bits = -int(math.log2(info.eps))
    return DtypeRange(dtype, min_normal, math.frexp(info.max)[1] - 1, min_normal - mantissa_bits)


def _scale_bits(scale: float) -> int:
    """``log2(scale)`` rounded down: the exponent shift a loss scale applies."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return math.frexp(scale)[1] - 1


class ExponentHistogram:
    """Counts of ``floor(log2|x|)`` over every value added, kept on the device.

    With ``dtype``, each value is first rounded to that dtype's precision (its
    mantissa width, round to nearest even), so that a value which rounds up to the next
    power of two in ``dtype`` counts there: float16's largest finite value is 65504,
    and 65520..65535 round to inf. Overflow and the normal-range boundary are then
    exact at every power-of-two scale. Without ``dtype`` values are binned as they are.

    ``add(tensor)`` costs a handful of element-wise kernels and one ``index_add_``
    and never syncs with the host; ``read()`` copies the 257 counters to the host
    once. Float16/bfloat16/float32/float64 tensors are accepted (float64 values
    beyond float32's range count in its top or bottom bin).
    """

    def __init__(self, device: torch.device | str | None = None, dtype: Any = None) -> None:
        self.dtype = None if dtype is None else as_dtype(dtype)
        self.counts: torch.Tensor | None = None
        if device is not None:
            self.counts = torch.zeros(NUM_BINS, dtype=torch.int64, device=device)

    def add(self, tensor: torch.Tensor) -> None:
        """Count the values of ``tensor`` (on its device; no host sync)."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"tensor must be a floating torch.Tensor, got {tensor!r:.80}")
        if self.counts is None:
            self.counts = torch.zeros(NUM_BINS, dtype=torch.int64, device=tensor.device)
        count_exponents_(self.counts, tensor, self.dtype)

    def read(self) -> ExponentCounts:
        """The counts on the host (one device-to-host copy)."""
        if self.counts is None:
            return ExponentCounts.empty()
        return ExponentCounts.from_bins(self.counts.tolist())


def _codes(flat: torch.Tensor, dtype: Any) -> torch.Tensor:
    """The counter index of each value of a 1-D tensor: its float32 exponent field (after
    rounding to ``dtype``'s mantissa width, if given), or 256 for an exact zero."""
    wide = flat
    if flat.dtype == torch.float64:
        # Finite float64 values beyond float32 land in float32's top bin, not at inf.
        wide = torch.where(flat.isfinite(), flat.clamp(-_FLOAT32_MAX, _FLOAT32_MAX), flat)
    bits = wide.float().view(torch.int32)
    codes = bits.bitwise_right_shift(23).bitwise_and_(255)
    dropped = 0 if dtype is None else _MANTISSA_BITS - _mantissa_bits(dtype)
    if dropped > 0:
        # Round to nearest even on the dropped mantissa bits; a carry lifts the exponent.
        # Finite values stay finite (at most 254, float32's top bin); inf/nan keep 255:
        # the max undoes a NaN payload's wrap-around.
        odd = bits.bitwise_right_shift(dropped).bitwise_and_(1)
        rounded = bits.add(odd).add_((1 << (dropped - 1)) - 1)
        rounded = rounded.bitwise_right_shift_(23).bitwise_and_(255).clamp_(max=254)
        codes = torch.maximum(codes, rounded)
    return torch.where(flat == 0, _ZEROS, codes)


def _flat(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    x = tensor.detach()
    if x.is_sparse:
        x = x.coalesce().values()
    if x.device != device:
        x = x.to(device, non_blocking=True)
    return x.reshape(-1)


@torch.no_grad()
def count_exponents_(counts: torch.Tensor, tensor: torch.Tensor, dtype: Any = None) -> None:
    """Add ``tensor``'s exponent counts into ``counts`` (int64, ``NUM_BINS`` long), in place.

    Runs on ``counts``' device: a handful of element-wise kernels and one
    ``index_add_``; no host sync.
    """
    flat = _flat(tensor, counts.device)
    if flat.numel():
        ones = torch.ones((), dtype=torch.int64, device=counts.device).expand(flat.numel())
        counts.index_add_(0, _codes(flat, dtype), ones)


@torch.no_grad()
def count_exponents_rows_(
    counts: torch.Tensor, tensors: Sequence[torch.Tensor], dtype: Any = None,
    chunk_elements: int = 1 << 24,
) -> None:  # fmt: skip
    """Add the histogram of ``tensors[i]`` into row ``i`` of ``counts`` (``(n, NUM_BINS)``).

    The same counts as :func:`count_exponents_` per tensor, in a fixed number of kernels
    per chunk of about ``chunk_elements`` values instead of per tensor: the chunk's
    tensors are concatenated, coded once, shifted to their rows by one multi-tensor
    add and counted by one ``index_add_``. Tensors of one dtype and device; no host sync.
    """
    if counts.shape != (len(tensors), NUM_BINS):
        raise ValueError(f"counts must have shape ({len(tensors)}, {NUM_BINS}), got {counts.shape}")
    rows = counts.view(-1)
    flats = [_flat(t, counts.device) for t in tensors]
    start = 0
    while start < len(flats):
        stop, size = start + 1, flats[start].numel()
        while stop < len(flats) and size + flats[stop].numel() <= chunk_elements:
            size += flats[stop].numel()
            stop += 1
        part = flats[start:stop]
        codes = _codes(part[0] if len(part) == 1 else torch.cat(part), dtype)
        pieces = [c for c in codes.split([f.numel() for f in part]) if c.numel()]
        offsets = [(start + i) * NUM_BINS for i, f in enumerate(part) if f.numel()]
        if pieces:
            torch._foreach_add_(pieces, offsets)
            ones = torch.ones((), dtype=torch.int64, device=counts.device).expand(codes.numel())
            rows.index_add_(0, codes, ones)
        start = stop


_MANTISSA_BITS = 23  # float32's


def _mantissa_bits(dtype: Any) -> int:
    return -int(math.log2(torch.finfo(as_dtype(dtype)).eps))


@dataclasses.dataclass(frozen=True)
class ExponentCounts:
    """A host-side exponent histogram: ``exponents[e]`` values with ``floor(log2|x|) == e``.

    ``exponents`` maps each exponent in use to its count; ``-127`` collects every
    nonzero value below ``2**-126``. ``zeros`` counts exact zeros, ``nonfinite`` infs
    and NaNs, ``total`` every value. Fractions are of ``total``.
    """

    exponents: Mapping[int, int]
    zeros: int
    nonfinite: int
    total: int

    @classmethod
    def empty(cls) -> ExponentCounts:
        return cls({}, 0, 0, 0)

    @classmethod
    def from_bins(cls, bins: Sequence[int]) -> ExponentCounts:
        """From :class:`ExponentHistogram`'s raw 257 counters."""
        if len(bins) != NUM_BINS:
            raise ValueError(f"expected {NUM_BINS} counters, got {len(bins)}")
        zeros, below = int(bins[_ZEROS]), int(bins[0])  # bin 0: nonzero, below 2**-126
        exponents = {b - _BIAS: int(n) for b, n in enumerate(bins[1:255], start=1) if n}
        if below:
            exponents[-_BIAS] = below
        total = sum(int(n) for n in bins)
        return cls(dict(sorted(exponents.items())), zeros, int(bins[255]), total)

    def __add__(self, other: ExponentCounts) -> ExponentCounts:
        merged = dict(self.exponents)
        for e, n in other.exponents.items():
            merged[e] = merged.get(e, 0) + n
        return ExponentCounts(
            dict(sorted(merged.items())),
            self.zeros + other.zeros,
            self.nonfinite + other.nonfinite,
            self.total + other.total,
        )

    # -- what a dtype and a scale do to these values ------------------------------------

    def _fraction(self, count: int) -> float:
        return count / self.total if self.total else 0.0

    def underflow_fraction(self, dtype: Any, scale: float = 1.0) -> float:
        """Fraction of values that become subnormal or zero in ``dtype`` after ``* scale``.

        Exact zeros are not counted: they are zero in every dtype.
        """
        limit = dtype_range(dtype).min_normal - _scale_bits(scale)
        return self._fraction(sum(n for e, n in self.exponents.items() if e < limit))

    def flush_fraction(self, dtype: Any, scale: float = 1.0) -> float:
        """Fraction of nonzero values that become exactly zero in ``dtype`` after ``* scale``."""
        limit = dtype_range(dtype).min_subnormal - 1 - _scale_bits(scale)
        return self._fraction(sum(n for e, n in self.exponents.items() if e < limit))

    def overflow_fraction(self, dtype: Any, scale: float = 1.0) -> float:
        """Fraction of values that are inf in ``dtype`` after ``* scale`` (non-finite included)."""
        limit = dtype_range(dtype).max - _scale_bits(scale)
        return self._fraction(
            self.nonfinite + sum(n for e, n in self.exponents.items() if e > limit)
        )

    def zero_fraction(self) -> float:
        """Fraction of values that are exactly zero."""
        return self._fraction(self.zeros)

    def exponent_range(self) -> tuple[int, int] | None:
        """``(smallest, largest)`` exponent of the finite nonzero values, or ``None``."""
        if not self.exponents:
            return None
        return min(self.exponents), max(self.exponents)

    def scale_interval(
        self, dtype: Any, tolerance: float, horizon: int | None = None
    ) -> tuple[float, float]:
        """The exponents ``k`` for which scale ``2**k`` keeps these values representable.

        Returns ``(lo, hi)``: from ``lo`` on, at most ``tolerance`` of the values
        underflow; up to ``hi``, none overflows. ``lo`` is ``-inf`` when nothing can
        underflow, ``hi`` is ``inf`` when there is no nonzero value and ``-inf`` when
        a value is already non-finite. ``lo > hi`` means no single scale works.
        With ``horizon``, values more than ``2**horizon`` below the largest do not
        count as underflowing (see :class:`~mixprec.diagnostics.PrecisionReport`).

        >>> counts = ExponentCounts({-30: 99, 0: 1}, 0, 0, 100)
        >>> counts.scale_interval(torch.float16, 0.01), counts.scale_interval("f16", 0.01, 24)
        ((16, 15), (-inf, 15))
        """
        rng = dtype_range(dtype)
        if self.nonfinite:
            return (-math.inf, -math.inf)
        if not self.exponents:
            return (-math.inf, math.inf)
        top = max(self.exponents)
        hi = rng.max - top
        floor = -math.inf if horizon is None else top - horizon
        allowed = tolerance * self.total
        # Underflowing at scale 2**k: every value with exponent < min_normal - k. Walk up
        # the exponents while the count below stays within the allowance.
        below, lo = 0, -math.inf
        for e, n in self.exponents.items():
            if e < floor:
                continue
            if below + n > allowed:
                lo = rng.min_normal - e
                break
            below += n
        return (lo, hi)

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` reads it back."""
        return {
            "total": self.total,
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
            "exponents": {str(e): n for e, n in self.exponents.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExponentCounts:
        try:
            exponents = {int(e): int(n) for e, n in data["exponents"].items()}
            counts = cls(
                dict(sorted(exponents.items())),
                int(data["zeros"]),
                int(data["nonfinite"]),
                int(data["total"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"not an exponent histogram: {err!r} in {dict(data)!r:.200}") from None
        if counts.total != counts.zeros + counts.nonfinite + sum(exponents.values()):
            raise ValueError(f"exponent histogram counts do not add up to total={counts.total}")
        return counts
