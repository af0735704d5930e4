"""Per-layer float8 statistics: amax, scale, saturation and overflow of each cast.

:func:`float8_stats` gathers the tensors (no host sync, cheap to call every step);
:func:`read_float8_stats` reads them all to floats in one transfer, for logging.

>>> from mixprec.float8 import Float8Linear
>>> model = nn.Sequential(Float8Linear(16, 16, recipe="delayed"))
>>> model(torch.ones(2, 16)).sum().backward()
>>> stats = read_float8_stats(model)
>>> stats["0"]["amax_input"], stats["0"]["amax_grad"], stats["0"]["saturated_fraction_input"]
(1.0, 1.0, 0.0)
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec._checks import check_instance
from mixprec.float8._linear import Float8Layer

#: The three tensors of a layer each statistic describes, and the scaling that casts each.
TENSORS = ("input", "weight", "grad")
_SCALINGS = {tensor: f"{tensor}_scaling" for tensor in TENSORS}
#: The statistics reported for each of a layer's three tensors.
STAT_NAMES = tuple(
    f"{stat}_{tensor}"
    for tensor in TENSORS
    for stat in ("amax", "scale", "saturated_fraction", "overflows")
)


def float8_stats(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer name: {statistic: 0-d tensor}}`` for every float8 layer in ``model``.

    Statistics, for ``input``, ``weight`` and ``grad`` (the output gradient):
    ``amax_*`` (largest magnitude in the last cast; inf/nan if it overflowed),
    ``scale_*`` (the scale of the last cast), ``saturated_fraction_*`` (fraction of
    the last cast's elements clipped at the float8 maximum) and ``overflows_*``
    (casts with an inf/nan amax so far). The values are detached copies. No host sync.
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    stats = {}
    for name, module in model.named_modules():
        if not isinstance(module, Float8Layer):
            continue
        layer = {}
        for tensor, attribute in _SCALINGS.items():
            scaling = getattr(module, attribute)
            layer[f"amax_{tensor}"] = scaling.amax.detach().clone()
            layer[f"scale_{tensor}"] = scaling.scale.detach().clone()
            layer[f"saturated_fraction_{tensor}"] = scaling.saturated_fraction().detach()
            layer[f"overflows_{tensor}"] = scaling.overflows.detach().long()  # a count
        stats[name] = layer
    return stats


def read_float8_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """:func:`float8_stats` as plain floats: one host sync for the whole model."""
    stats = float8_stats(model)
    values = [v for layer in stats.values() for v in layer.values()]
    if not values:
        return {}
    # Gathered on one device first: a per-value read would sync once per value.
    values = [v.float().to(values[0].device) for v in values]
    flat = iter(torch.stack(values).tolist())  # the one read back to the host
    return {name: {key: next(flat) for key in layer} for name, layer in stats.items()}
