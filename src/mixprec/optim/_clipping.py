"""Gradient clipping on unscaled gradients, with fused multi-tensor ops.

The three clipping options. All take a list of gradients that are
already unscaled (clipping scaled gradients would clip at ``scale`` times the
intended threshold, the mistake this module exists to avoid) and work in place
without host syncs. Norms are the whole model's where it is sharded: FSDP2
(``fully_shard``) gradients are DTensors, reduced across their mesh by DTensor;
FSDP1 flat parameters are plain tensors holding this rank's slice, whose squares
are summed over the process group (per-tensor ``clipnorm`` cannot be computed on a
slice and raises ``NotImplementedError``).

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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from mixprec.loss_scale import reduction_group
from mixprec.numerics import (
    global_norm,
    group_by_device_and_dtype,
    is_dtensor,
    local_shards,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor



def _by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Groups for fused ops: by device and dtype, DTensors apart from ordinary tensors."""
    dtensors = [t for t in tensors if is_dtensor(t)]
    plain = [t for t in tensors if not is_dtensor(t)]
    return [g for part in (plain, dtensors) for g in group_by_device_and_dtype(part).values()]


def clip_by_value_(grads: list[torch.Tensor], clipvalue: float) -> None:
    """Clamp every gradient element into ``[-clipvalue, clipvalue]``."""
    for group in _by_kind(grads):
        torch._foreach_clamp_min_(group, -clipvalue)
        torch._foreach_clamp_max_(group, clipvalue)


def clip_by_norm_(grads: list[torch.Tensor], clipnorm: float) -> None:
    """Rescale each gradient separately so that its L2 norm is at most ``clipnorm``.

    A DTensor gradient (FSDP2) is clipped by its whole tensor's norm, not its shard's."""
    for group in _by_kind(grads):
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        if is_dtensor(group[0]):  # partial norms: one collective makes them whole tensors'
            # The norms of DTensors are DTensors, and so is their stack.
            norms = cast("DTensor", torch.stack(norms)).full_tensor().unbind()
        # g * clipnorm / max(norm, clipnorm): 1 when the norm is already small enough.
        factors = torch._foreach_maximum(norms, clipnorm)
        torch._foreach_reciprocal_(factors)
        torch._foreach_mul_(factors, clipnorm)
        torch._foreach_mul_(local_shards(group), [f.to(g.dtype) for f, g in zip(factors, group)])


def clip_by_global_norm_(
    grads: list[torch.Tensor],
    clipnorm: float,
    *,
    shards: Sequence[torch.Tensor] = (),
    process_group: Any = None,
) -> torch.Tensor:
    """Rescale all gradients together so that their joint L2 norm is at most ``clipnorm``.

    The norm is the whole model's where it is sharded: DTensor gradients (FSDP2) count
    in full, and ``shards`` (this rank's slices of FSDP1 flat parameters) are summed over
    ``process_group`` (:func:`norm_across_ranks`). Returns
    the norm before clipping (a float32 tensor; reading it syncs).
    """
    if not grads and not shards:
        return torch.zeros(())
    total = norm_across_ranks(grads, shards, process_group)
    factor = clipnorm / total.clamp(min=clipnorm)
    for group in _by_kind([*grads, *shards]):
        g = group[0]
        torch._foreach_mul_(local_shards(group), factor.to(device=g.device, dtype=g.dtype))
    return total


def clip_gradients_(
    grads: list[torch.Tensor],
    clipvalue: float | None = None,
    clipnorm: float | None = None,
    global_clipnorm: float | None = None,
    *,
    shards: Sequence[torch.Tensor] = (),
    process_group: Any = None,
) -> None:
    """Apply the clipping options that are set, in order: value, per-tensor norm, global norm.

    ``shards``/``process_group``: see :func:`clip_by_global_norm_` (the per-tensor norm of
    a slice of a flat parameter means nothing: ``clipnorm`` ignores ``shards``).
    """
    if clipvalue is not None:
        clip_by_value_([*grads, *shards], clipvalue)
    if clipnorm is not None:
        clip_by_norm_(grads, clipnorm)
    if global_clipnorm is not None:
        clip_by_global_norm_(grads, global_clipnorm, shards=shards, process_group=process_group)


def decay_(param_groups: list[dict[str, Any]], weight_decay: float, applied: torch.Tensor) -> None:
    """Decoupled weight decay ``p *= 1 - lr * weight_decay * applied`` on every parameter
    with a gradient (``applied``: a 0/1 tensor, 0 on a skipped step). No host sync."""
    for group in param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            factor = 1.0 - group["lr"] * weight_decay * applied
            for p in params:
                p.mul_(factor.to(p.device, p.dtype))


# -- sharded parameters ------------------------------------------------------------------


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor reduced to an ordinary tensor (a collective if it is partial)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def norm_across_ranks(
    grads: list[torch.Tensor], shards: Sequence[torch.Tensor] = (), process_group: Any = None
) -> torch.Tensor:
    """The L2 norm of all gradients of the model, where parts of it live on other ranks.

    ``grads``: ordinary tensors (whole on this rank) and DTensors (reduced across their
    mesh by DTensor). ``shards``: this rank's slices of tensors split over
    ``process_group`` (FSDP1 flat parameters): their squares are summed over the group.
    A float32 scalar; no host sync (a collective where anything is sharded).
    """
    dtensors = [g for g in grads if is_dtensor(g)]
    if not shards and not dtensors:  # nothing sharded: the plain norm
        return global_norm(grads) if grads else torch.zeros((), dtype=torch.float32)
    parts = []
    plain = [g for g in grads if not is_dtensor(g)]
    if plain:
        parts.append(global_norm(plain))
    if dtensors:
        parts.append(_full(global_norm(dtensors)))
    if shards:
        squares = global_norm(shards).square()
        group = reduction_group(process_group)
        if group is not None:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
        parts.append(squares.sqrt())
    if len(parts) < 2:
        return parts[0] if parts else torch.zeros((), dtype=torch.float32)
    device = parts[0].device
    return torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]), 2.0)
