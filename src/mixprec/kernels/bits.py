"""Bit codecs of a float32 master beside its bfloat16 weight, and bit packing.

A float32 number is a bfloat16 number (its high 16 bits) and 16 more bits, so a
float32 master whose bfloat16 weight is the model's needs only what the weight lacks:
the low 16 bits (:func:`split_bits`/:func:`join_bits`, exact) or an 8-bit correction
(:func:`split8_bits`/:func:`join8_bits`, within 129 float32 ulps). Pure tensor
functions: they import nothing of mixprec.
"""

from __future__ import annotations

import sys

import torch

_TIE = 1 << 15


def bfloat16_bits32(weight: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of bfloat16 ``weight`` widened to float32: its 16 bits
    shifted up, which is what the float32 conversion does (NaN payloads included), in
    one kernel instead of a reinterpretation, a widening and a shift.

    >>> hex(int(bfloat16_bits32(torch.tensor([1.0], dtype=torch.bfloat16))))
    '0x3f800000'
    """
    return weight.float().view(torch.int32)


def split_bits(master: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int16 ``d``, one packed bit per element: is ``d`` ``+2**15``) for float32 ``master``
    and its round-to-nearest bfloat16 ``weight``.

    The tie bits are packed eight to a byte (uint8, ``ceil(n / 8)`` of them), so the split
    has a fixed size and never waits for the device (an index list of the ties would).

    >>> m = torch.tensor([1.0 + 2.0**-8, -3.0])  # a tie: halfway between two bfloat16s
    >>> d, ties = split_bits(m, m.bfloat16())
    >>> torch.equal(join_bits(m.bfloat16(), d, ties), m), ties.tolist()
    (True, [1])
    """
    diff = master.view(torch.int32) - bfloat16_bits32(weight)
    tie = pack_bits((diff == _TIE).flatten())
    return diff.to(torch.int16), tie  # +2**15 wraps to -2**15; the tie bits say where


def join_bits(weight: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The float32 master that :func:`split_bits` split (bit-exact)."""
    bits = bfloat16_bits32(weight) + low.to(torch.int32)
    tie = unpack_bits(ties, bits.numel()).view(bits.shape)
    bits += tie.to(torch.int32).mul_(2 * _TIE)  # -2**15 back
    return bits.view(torch.float32)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flat 0/1 ``bits`` (bool or any integer dtype) packed eight to a byte, the first in
    the lowest bit: ``ceil(n / 8)`` uint8, in three kernels (a shift by each bit's place
    and a sum over rows of eight, after the zero padding).

    >>> pack_bits(torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1])).tolist()
    [9, 1]
    """
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, -bits.numel() % 8))
    return (padded.view(-1, 8) << _bit_places(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` of :func:`pack_bits`'s bits, one uint8 0/1 each (flat).

    >>> unpack_bits(torch.tensor([9, 1], dtype=torch.uint8), 9).tolist()
    [1, 0, 0, 1, 0, 0, 0, 0, 1]
    """
    return (packed.unsqueeze(1) >> _bit_places(packed.device)).bitwise_and_(1).flatten()[:n]


_PLACES: dict[torch.device, torch.Tensor] = {}


def _bit_places(device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., 7]`` as uint8 on ``device`` (made once per device)."""
    if device not in _PLACES:
        _PLACES[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _PLACES[device]



def high_halves(bits: torch.Tensor) -> torch.Tensor:
    """The high 16 bits of each element of int32 ``bits``, as int16, shaped as ``bits``:
    a strided view where ``bits`` is contiguous (a copy of it otherwise). Copied into a
    bfloat16 tensor's int16 view, they are the float32 values truncated to bfloat16, in
    one kernel where masking the low bits and converting take two.

    >>> x = torch.tensor([1.0 + 2.0**-7 + 3 * 2.0**-9, -3.0])  # 3/4 of an ulp above 1 + 2**-7
    >>> cut = high_halves(x.view(torch.int32)).view(torch.bfloat16)
    >>> cut.tolist(), x.bfloat16().tolist()  # truncated; rounded to nearest
    ([1.0078125, -3.0], [1.015625, -3.0])
    """
    halves = bits.reshape(-1).view(torch.int16)
    high = 1 if sys.byteorder == "little" else 0  # which int16 of an int32 holds its top
    return halves[high::2].view(bits.shape)


#: float32 units in the last place per correction unit. 255 codes (-127..127) of 258
#: ulps each cover the 2**16 + 1 bit distances a round-to-nearest weight can be from
#: its master (-2**15..2**15) with at most 129 ulps of error, and code 0 is exact.
CORRECTION_STEP = 258


def split8_bits(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The int8 correction of float32 ``master`` over its bfloat16 ``weight``.

    ``d = bits(master) - bits(weight) << 16`` counts the float32 ulps from the weight
    (as rounded) to the master: ``-2**15 <= d <= 2**15`` when the weight is the master
    rounded to nearest (the sign and exponent range of bfloat16 are float32's, so
    zeros, subnormals and signs round into place). The correction is ``d`` in units of
    :data:`CORRECTION_STEP` ulps, rounded to nearest: about 1/254 of the weight's
    bfloat16 ulp. Codes outside -127..127 (a weight that is not the rounded master: inf
    from an overflowed master, NaN payloads) are clamped, so :func:`join8_bits` never
    leaves the weight's neighbourhood.

    >>> m = torch.tensor([1.0 + 2.0**-9, -3.0, 0.0])
    >>> split8_bits(m, m.bfloat16()).tolist()  # a quarter ulp up; exact; exact
    [64, 0, 0]
    """
    return split8_codes(master, weight).to(torch.int8)


def split8_codes(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`split8_bits` with the codes still float32 (whole numbers): a compiled step
    blends them with the old ones on a skip while they are floats (an int8 blend
    compiles to a scalar loop per vector on a CPU)."""
    # One fresh buffer, worked in place (on a CPU a fresh large buffer costs as much as
    # a pass over it: its pages are faulted in).
    d = bfloat16_bits32(weight)
    torch.sub(master.view(torch.int32), d, out=d)
    # floor((d + 129) / 258) in float32, 2-3x faster than integer floor division on a
    # CPU and equal to it: a sum below 2**24 is exact in float32 and its quotient is an
    # integer or at least 1/258 from one, so the rounded division floors alike; larger
    # sums are clamped to +-127 either way. Each element is converted where it lies.
    q = d.add_(CORRECTION_STEP // 2).view(torch.float32).copy_(d)
    return q.div_(CORRECTION_STEP).floor_().clamp_(-127, 127)


def join8_bits(weight: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The float32 master rebuilt from its bfloat16 ``weight`` and int8 ``correction``.

    **Error bound.** For a finite weight that is the master rounded to nearest, the
    rebuilt master is within 129 float32 ulps of the master, counted along the bit
    patterns: ``|bits(join8(w, split8(m, w))) - bits(m)| <= 129``. Both lie within half
    a bfloat16 ulp of ``w``, so in ``w``'s binade or (for ``w`` a power of two) the one
    below, where float32 ulps are no larger than ``ulp32(w)``; hence::

        |rebuilt - master| <= 129 * ulp32(w) = 129 * 2**-16 * ulp_bf16(w)   (< 0.002 ulp_bf16)
        |rebuilt - master| <= 129 * 2**-23 * |w|  (about 2**-16 relative; normal w)

    where ``ulp32(w)`` is the float32 spacing at ``|w|`` (``2**-149`` for zeros and
    subnormals). Values bfloat16 holds exactly (zeros of either sign included) come
    back exactly, and the rebuilt master rounds to ``w`` again (its distance stays
    below half a bfloat16 ulp), so splitting it again gives the same correction. An
    infinite weight (a master beyond bfloat16's range) comes back infinite, a NaN as NaN.
    A correction paired with another weight than its own (a model loaded after its
    optimizer) gives a value within half a bfloat16 ulp of that weight, never across zero.

    >>> w = torch.tensor([1.0], dtype=torch.bfloat16)
    >>> float(join8_bits(w, torch.tensor([64], dtype=torch.int8)))  # 1 + 64 * 258 * 2**-23
    1.0019683837890625
    """
    high = bfloat16_bits32(weight)
    offset = correction.to(torch.int32).mul_(CORRECTION_STEP)
    # A weight of +-0 with a correction pointing below zero (one split from another
    # weight: the model was loaded after the optimizer) stays +-0, not NaN.
    torch.maximum(offset, (high & 0x7FFFFFFF).neg_(), out=offset)
    return high.add_(offset).view(torch.float32)


def split8_error_bound(weight: torch.Tensor) -> torch.Tensor:
    """The bound of :func:`join8_bits` per element: ``129 * ulp32(weight)`` (float32).

    >>> split8_error_bound(torch.tensor([1.0, 0.0], dtype=torch.bfloat16)).tolist()
    [1.537799835205078e-05, 1.807675018979014e-43]
    """
    magnitude = weight.float().abs()
    above = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf")))
    return (above - magnitude) * 129
