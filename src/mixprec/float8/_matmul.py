"""The scaled float8 matmul: ``torch._scaled_mm`` where the device has it, else emulated.

``torch._scaled_mm`` needs float8 matmul support from the device: GPUs with float8
units (compute capability 8.9 and up) and CPUs whose oneDNN build has a float8
kernel (AVX512 and AMX machines; an AVX2-only CPU has none and raises). Where it
is missing, :func:`scaled_mm` computes the same thing from the same float8 inputs:
every product of two float8 values is exact in float32 (at most 4 x 4 significant
bits), so the emulation differs from the kernel only in the order of the float32
sums. It is as accurate and no faster than float32: float8's numerics everywhere,
its speed only where the hardware has it.

>>> a = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
>>> b = torch.tensor([[3.0], [0.5]]).to(torch.float8_e4m3fn)
>>> one = torch.tensor(1.0)
>>> scaled_mm(a, b, one, torch.tensor(2.0), torch.float32)
tensor([[8.]])
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

_PROBED: dict[str, bool] = {}


def _assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo.

    That decorator only marks ``fn`` (``fn._dynamo_marked_constant = True``), and Dynamo
    reads the mark when it traces a call to ``fn``; but it imports all of Dynamo first
    (~1 s, most of ``import mixprec.float8``). The mark is set here directly, the way
    torch marks its own ``justknobs_check``; where Dynamo is loaded already, its own
    decorator does it.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# A constant to torch.compile: the probe runs at trace time, not in the graph.
@_assume_constant_result
def native_scaled_mm(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` runs on this kind of device (probed once, cached).

    Where it does not (AVX2-only CPUs, GPUs below compute capability 8.9), float8 layers
    compute through :func:`scaled_mm`'s float32 emulation: float8's numerics, float32's
    speed.

    >>> native_scaled_mm("cpu") in (True, False)
    True
    """
    if device_type not in _PROBED:
        _PROBED[device_type] = _probe(device_type)
    return _PROBED[device_type]


def _probe(device_type: str) -> bool:
    device = torch.device(device_type)
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):  # no float8 kernel for this device
        return False
    return True


def _rowwise_scale(scale: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``scale`` as ``torch._scaled_mm``'s rowwise mode takes it: ``(rows, columns)`` (one of
    them 1) with row-major strides. A scale given so is passed as is (eagerly each view
    is a dispatch); a transposed one is rewritten (a transposed ``(1, M)`` has the shape
    but not the strides) and a single value is spread over the rows (columns)."""
    if scale.shape == (rows, columns) and scale.stride() == (columns, 1):
        return scale
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, columns).contiguous()
    return scale.flatten().view(rows, columns)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a @ b) * scale_a * scale_b`` in ``out_dtype``, from float8 ``a`` and ``b``.

    Each scale is one value (per tensor) or one per row: ``scale_a`` ``(M, 1)`` for the
    rows of ``a`` and ``scale_b`` ``(1, N)`` for the columns of ``b`` (rowwise scaling,
    :class:`~mixprec.float8.RowwiseScaling`); a single value beside a per-row one is
    broadcast.

    ``torch._scaled_mm`` where :func:`native_scaled_mm` says the device has it (then ``b``
    must be column-major, as that kernel wants), else a float32 emulation from the same
    float8 inputs: every product of two float8 values is exact in float32, so the two
    differ only in the order of the float32 sums. It is the matmul of
    :class:`Float8Linear`, for float8 layers of one's own.

    >>> a = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
    >>> b = torch.tensor([[3.0, 1.0], [0.5, 4.0]]).to(torch.float8_e4m3fn).t().contiguous().t()
    >>> scaled_mm(a, b, torch.tensor(1.0), torch.tensor(2.0), torch.float32)
    tensor([[ 8., 18.]])
    >>> scaled_mm(a, b, torch.tensor([[1.0]]), torch.tensor([[2.0, 0.5]]), torch.float32)
    tensor([[8.0000, 4.5000]])
    """
    if native_scaled_mm(a.device.type):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            scale_a = _rowwise_scale(scale_a, a.shape[0], 1)
            scale_b = _rowwise_scale(scale_b, 1, b.shape[1])
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return (a.float() @ b.float() * (scale_a * scale_b)).to(out_dtype)
