"""Adam's two moments in 8 bits per element: block-scaled codes and their decoding.

The storage format (per parameter, its elements flattened and cut into blocks, the
last zero-padded):

* first moment ``m``: per block the absolute maximum ``s`` (float32); each element
  ``x = m / s`` in ``[-1, 1]`` is companded ``c = 2x / (1 + |x|)`` (twice the
  resolution near zero, where most of a block's values lie) and stored as the int8
  ``round(127 c)``. Decoded: ``x = c / (2 - |c|)``, ``m = s x``.
* second moment ``v``: per block the maximum ``t`` of ``sqrt(v)`` (float32); each
  element is stored as the uint8 ``round(255 sqrt(v) / t)``, at least 1 where
  ``v > 0``: a small ``v`` may be overestimated (a smaller step), never zeroed.

Codes round to nearest, or stochastically with a noise in ``[0, 1)``
(:func:`noise_from_bits`). Pure tensor functions: they import nothing of mixprec.
"""

from __future__ import annotations

import torch


def _round(x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """Round to nearest, or stochastically: ``floor(x + noise)`` with ``noise`` uniform in
    ``[0, 1)`` rounds up with probability equal to the distance from below (unbiased)."""
    return torch.round(x) if noise is None else torch.floor(x + noise)


def quantize_first_moment(
    m: torch.Tensor, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, float32 block absmax) of float32 ``m`` shaped ``(blocks, block_size)``;
    ``noise`` (uniform in ``[0, 1)``, ``m``'s shape) rounds the codes stochastically.

    >>> q, s = quantize_first_moment(torch.tensor([[0.5, -1.0, 0.0, 0.01]]))
    >>> q.tolist(), s.tolist()  # 2x/(1+|x|): 0.5 -> 0.667 -> 85; 0.01 -> 0.0198 -> 3
    ([[85, -127, 0, 3]], [1.0])
    """
    codes, scale = first_moment_codes(m, noise)
    return codes.to(torch.int8), scale


def first_moment_codes(
    m: torch.Tensor, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_first_moment` with the codes still float32 (whole numbers)."""
    scale = m.abs().amax(dim=1)
    x = m / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    companded = 2 * x / (1 + x.abs())
    return _round(companded * 127, noise).clamp_(-127, 127), scale


def dequantize_first_moment(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``m`` from :func:`quantize_first_moment`'s codes and scales.

    >>> q, s = quantize_first_moment(torch.tensor([[0.5, -1.0, 0.0, 0.01]]))
    >>> [round(v, 4) for v in dequantize_first_moment(q, s)[0].tolist()]
    [0.503, -1.0, 0.0, 0.012]
    """
    c = q.to(torch.float32) / 127
    return c / (2 - c.abs()) * scale.unsqueeze(1)


def quantize_second_moment(
    v: torch.Tensor, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, float32 block max of ``sqrt(v)``) of float32 ``v >= 0`` shaped
    ``(blocks, block_size)``; a nonzero ``v`` never gets code 0. ``noise`` as in
    :func:`quantize_first_moment`.

    >>> q, s = quantize_second_moment(torch.tensor([[4.0, 1.0, 0.0, 1e-9]]))
    >>> q.tolist(), s.tolist()
    ([[255, 128, 0, 1]], [2.0])
    """
    codes, scale = second_moment_codes(v, noise)
    return codes.to(torch.uint8), scale


def second_moment_codes(
    v: torch.Tensor, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_second_moment` with the codes still float32 (whole numbers)."""
    root = v.sqrt()
    scale = root.amax(dim=1)
    u = root / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    codes = _round(u * 255, noise).clamp_(0, 255)
    # At least 1 where v > 0: sign(v) is 1 there and 0 at v = 0 (where codes are 0). A
    # bool mask and a blend by it cost several float operations each on a CPU.
    return codes.maximum(v.sign()), scale


def dequantize_second_moment(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` from :func:`quantize_second_moment`'s codes and scales.

    >>> q, s = quantize_second_moment(torch.tensor([[4.0, 1.0, 0.0, 1e-9]]))
    >>> [round(v, 4) for v in dequantize_second_moment(q, s)[0].tolist()]
    [4.0, 1.0079, 0.0, 0.0001]
    """
    root = q.to(torch.float32) * (scale.unsqueeze(1) / 255)
    return root * root


def noise_from_bits(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two stochastic-rounding noises (float32, in ``[0, 1)``) that one draw of
    non-negative int32 ``bits`` (31 random bits each, ``random_()``'s) carries: its low 16
    bits for the first moment, the 15 above them for the second. One draw per element
    instead of two ``rand`` calls, a third of the generator's work; a noise of 15 or 16
    bits rounds an 8-bit code with a bias of at most ``2**-15`` of a code.

    >>> m, v = noise_from_bits(torch.tensor([0x7FFFFFFF, 0x00018000], dtype=torch.int32))
    >>> m.tolist(), v.tolist()
    ([0.9999847412109375, 0.5], [0.999969482421875, 3.0517578125e-05])
    """
    return (bits & 0xFFFF).float() * 2.0**-16, (bits >> 16).float() * 2.0**-15
