"""Gradient clipping on unscaled gradients, with fused multi-tensor ops.

The three clipping options. All take a list of gradients that are
already unscaled (clipping scaled gradients would clip at ``scale`` times the
intended threshold, the mistake this module exists to avoid) and work in place
without host syncs.

>>> import torch
>>> g = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 10.0])]
>>> clip_by_norm_(g, 1.0); g[0]
tensor([0.6000, 0.8000])
>>> g = [torch.tensor([3.0, 4.0])]
>>> clip_by_value_(g, 3.5); g[0]
tensor([3.0000, 3.5000])
>>> g = [torch.tensor([3.0]), torch.tensor([4.0])]
>>> float(clip_by_global_norm_(g, 1.0))   # returns the norm before clipping
5.0
>>> g
[tensor([0.6000]), tensor([0.8000])]
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._checks import check_number
from mixprec.numerics import global_norm, group_by_device_and_dtype

__all__ = [
    "clip_by_value_",
    "clip_by_norm_",
    "clip_by_global_norm_",
    "clip_gradients_",
    "check_clip_options",
    "decay_",
]


def _check_threshold(name: str, value: Any) -> None:
    check_number(name, value, minimum=0, exclusive=True, allow_none=True)


def check_clip_options(clipnorm: Any, clipvalue: Any, global_clipnorm: Any) -> None:
    """Validate the clipping options together (``clipnorm`` excludes ``global_clipnorm``)."""
    _check_threshold("clipnorm", clipnorm)
    _check_threshold("clipvalue", clipvalue)
    _check_threshold("global_clipnorm", global_clipnorm)
    if clipnorm is not None and global_clipnorm is not None:
        raise ValueError(
            f"clipnorm={clipnorm!r} and global_clipnorm={global_clipnorm!r} were both set; "
            "they clip the same thing two ways, so set at most one of them"
        )


def clip_by_value_(grads: list[torch.Tensor], clipvalue: float) -> None:
    """Clamp every gradient element into ``[-clipvalue, clipvalue]``."""
    for group in group_by_device_and_dtype(grads).values():
        torch._foreach_clamp_min_(group, -clipvalue)
        torch._foreach_clamp_max_(group, clipvalue)


def clip_by_norm_(grads: list[torch.Tensor], clipnorm: float) -> None:
    """Rescale each gradient separately so that its L2 norm is at most ``clipnorm``."""
    for group in group_by_device_and_dtype(grads).values():
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        # g * clipnorm / max(norm, clipnorm): 1 when the norm is already small enough.
        factors = torch._foreach_maximum(norms, clipnorm)
        torch._foreach_reciprocal_(factors)
        torch._foreach_mul_(factors, clipnorm)
        torch._foreach_mul_(group, [f.to(g.dtype) for f, g in zip(factors, group)])


def clip_by_global_norm_(grads: list[torch.Tensor], clipnorm: float) -> torch.Tensor:
    """Rescale all gradients together so that their joint L2 norm is at most ``clipnorm``.

    Returns the norm before clipping (a float32 tensor; reading it syncs).
    """
    if not grads:
        return torch.zeros(())
    total = global_norm(grads)
    factor = clipnorm / total.clamp(min=clipnorm)
    for (device, dtype), group in group_by_device_and_dtype(grads).items():
        torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))
    return total


def clip_gradients_(
    grads: list[torch.Tensor],
    clipvalue: float | None = None,
    clipnorm: float | None = None,
    global_clipnorm: float | None = None,
) -> None:
    """Apply the clipping options that are set, in order: value, per-tensor norm, global norm."""
    if clipvalue is not None:
        clip_by_value_(grads, clipvalue)
    if clipnorm is not None:
        clip_by_norm_(grads, clipnorm)
    if global_clipnorm is not None:
        clip_by_global_norm_(grads, global_clipnorm)


def decay_(param_groups: list[dict[str, Any]], weight_decay: float, applied: torch.Tensor) -> None:
    """Decoupled weight decay ``p *= 1 - lr * weight_decay * applied`` on every parameter
    with a gradient (``applied``: a 0/1 tensor, 0 on a skipped step). No host sync."""
    for group in param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            factor = 1.0 - group["lr"] * weight_decay * applied
            for p in params:
                p.mul_(factor.to(p.device, p.dtype))
