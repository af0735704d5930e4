"""Stochastic rounding to bfloat16 and the random bits it adds.

Rounding a float32 value to bfloat16 stochastically adds 16 random bits below the
kept ones and truncates: the value rounds up with probability equal to its distance
from the bfloat16 number below. :func:`add_rounding_noise_` draws the bits from a
generator (the eager step); :func:`hashed_bits` computes them from a seed and each
element's index (the compiled step: no noise tensor in memory). Pure tensor
functions: they import nothing of mixprec above the kernels (numerics is below).
"""

from __future__ import annotations

import torch

from mixprec.kernels.bits import high_halves
from mixprec.numerics import cpu_shortcuts


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16, up or down with probability by distance.

    Adds 16 random low bits to the float32 pattern and truncates them, so a value that
    bfloat16 holds exactly is returned unchanged.

    >>> stochastic_round(torch.tensor([1.0, -2.5]))
    tensor([ 1.0000, -2.5000], dtype=torch.bfloat16)
    """
    bits = x.to(torch.float32, copy=True).view(torch.int32)  # one copy, whatever x's dtype
    rounded = torch.empty_like(x, dtype=torch.bfloat16)
    rounded.view(torch.int16).copy_(high_halves(add_rounding_noise_(bits, generator)))
    return rounded


def add_rounding_noise_(
    bits: torch.Tensor, generator: torch.Generator | None, masked: bool | None = None
) -> torch.Tensor:
    """Add uniform random 16-bit noise (``0 <= noise < 2**16``) to each element of int32
    ``bits``, in place, from ``generator`` (the device's default if ``None``); returns
    ``bits``. Truncating the low 16 bits after it rounds a float32 pattern to bfloat16
    stochastically.

    The noise is ``randint(0, 2**16)``'s, element for element. On a CPU it is drawn as
    ``random_()`` (one generator call an element, reduced modulo ``2**31``, a constant)
    and masked to its low 16 bits, which is what ``randint`` computes with a division by
    a run-time range: measured, 201 against 282 us for 69,632 elements on one thread,
    the add included. On a GPU ``randint`` is one kernel, the mask would be another.
    ``masked`` picks the way (``None``: masked where :func:`~mixprec.numerics.cpu_shortcuts`
    says so, ``randint`` elsewhere).

    >>> bits = torch.zeros(6, dtype=torch.int32)
    >>> noise = add_rounding_noise_(bits, torch.Generator().manual_seed(0))
    >>> expected = torch.randint(0, 2**16, (6,), dtype=torch.int32,
    ...                          generator=torch.Generator().manual_seed(0))
    >>> noise is bits, torch.equal(bits, expected)
    (True, True)
    """
    if masked is None:
        masked = cpu_shortcuts(bits.device)
    if masked:
        noise = torch.empty(bits.shape, dtype=torch.int32, device=bits.device)
        noise.random_(generator=generator)
        return bits.add_(noise.bitwise_and_(0xFFFF))
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32,
                          generator=generator)  # fmt: skip
    return bits.add_(noise)


_MASK32 = 0xFFFFFFFF


def _times32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``x * factor`` modulo ``2**32`` for int64 ``x`` in ``[0, 2**32)``, in one product
    below ``2**63`` (an int64 overflow would be undefined): a factor of ``2**31`` or more
    is ``-(2**32 - factor)`` modulo ``2**32``."""
    if factor < 2**31:
        return (x * factor) & _MASK32
    return -(x * (2**32 - factor)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" mixer: xor-shifts and two odd multipliers,
    a bijection whose output bits each depend on every input bit), on int64 holding 32 bits."""
    x = x ^ (x >> 16)
    x = _times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hashed_bits(
    seed: torch.Tensor, stream: int, shape: torch.Size, device: torch.device, bits: int = 16
) -> torch.Tensor:
    """``bits`` random bits (1 to 31) per element of a tensor of ``shape`` (int32 in
    ``[0, 2**bits)``), a pure function of the int64 ``seed`` (a 1-element tensor, drawn
    once a step from the optimizer's generator), the parameter's number ``stream`` in
    the step and the element's index: ``mix(mix(index) ^ mix(seed + stream * golden))``,
    its high ``bits`` bits. Counter-based, so a compiled loop computes it in registers
    (no noise tensor is written or read) and the eager run gives the same bits.

    >>> seed = torch.tensor([7])
    >>> a = hashed_bits(seed, 0, torch.Size([4]), torch.device("cpu"))
    >>> torch.equal(a, hashed_bits(seed, 0, torch.Size([4]), torch.device("cpu")))
    True
    >>> bool(a.ge(0).all() and a.lt(2**16).all())
    True
    >>> torch.equal(hashed_bits(seed, 0, torch.Size([4]), torch.device("cpu"), bits=31) >> 15, a)
    True
    """
    key = _mix32((seed + stream * 0x9E3779B9) & _MASK32)
    index = torch.arange(shape.numel(), dtype=torch.int64, device=device)
    return (_mix32(_mix32(index) ^ key) >> (32 - bits)).to(torch.int32).view(shape)
