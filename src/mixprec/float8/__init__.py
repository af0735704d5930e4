"""Float8 training: linear layers whose matmuls run in float8 with per-tensor scaling.

The parts: :mod:`~mixprec.float8._scaling` (the scaling recipes, state machines in
buffers), :mod:`~mixprec.float8._linear` (:class:`Float8Linear`, and
:class:`Float8Conv1D` for Hugging Face's ``Conv1D``), :mod:`~mixprec.float8._convert`
(:func:`convert_to_float8` and its report, :func:`convert_from_float8` back to the plain
architecture), :mod:`~mixprec.float8._rowwise` (the rowwise recipes: a scale per row of
each matmul operand) and :mod:`~mixprec.float8._stats` (per-layer amax and saturation).
Activations and weights are cast to float8_e4m3fn, output gradients to float8_e5m2
(e4m3 too with the rowwise recipes); all three
matmuls of a linear layer run through :func:`scaled_mm`: ``torch._scaled_mm`` where the
device has a float8 kernel (:func:`native_scaled_mm`), else its float32 emulation.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> report = convert_to_float8(model, "delayed", history_len=16)
>>> report.converted
['0', '2']
>>> loss = model(torch.randn(8, 16)).square().mean()
>>> loss.backward(); opt.step()
>>> sorted(read_float8_stats(model)["2"])[:4]
['amax_grad', 'amax_input', 'amax_weight', 'overflows_grad']
"""

from mixprec.float8._convert import (
    Float8Decision,
    Float8Report,
    convert_from_float8,
    convert_to_float8,
)
from mixprec.float8._fsdp import (
    Float8AllGatherWeight,
    Float8GatheredWeight,
    enable_fsdp_float8_all_gather,
    precompute_float8_amax_for_fsdp,
)
from mixprec.float8._linear import Float8Conv1D, Float8Layer, Float8Linear
from mixprec.float8._matmul import native_scaled_mm, scaled_mm
from mixprec.float8._rowwise import RowwiseScaling, RowwiseWithGwHpScaling
from mixprec.float8._scaling import (
    DelayedScaling,
    DynamicScaling,
    Float8Scaling,
    as_float8_dtype,
    make_scaling,
)
from mixprec.float8._stats import float8_stats, read_float8_stats

__all__ = [
    "convert_to_float8",
    "convert_from_float8",
    "Float8Report",
    "Float8Decision",
    "Float8Layer",
    "Float8Linear",
    "Float8Conv1D",
    "enable_fsdp_float8_all_gather",
    "precompute_float8_amax_for_fsdp",
    "Float8AllGatherWeight",
    "Float8GatheredWeight",
    "Float8Scaling",
    "DynamicScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "RowwiseWithGwHpScaling",
    "make_scaling",
    "as_float8_dtype",
    "float8_stats",
    "read_float8_stats",
    "scaled_mm",
    "native_scaled_mm",
]
