"""Fused numerical kernels on lists of tensors: unscale + finite check, norms; and the
kinds of tensor they meet (DTensor parameters of FSDP2, FSDP1 flat shards).

Everything here works on lists of tensors at once, grouped by (device, dtype), so
that a model with hundreds of parameters costs a handful of kernel launches, and
nothing here reads a value back to the host (no ``.item()``): results stay tensors
on the device.

>>> import torch
>>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
>>> found_inf = unscale_and_check_(grads, inv_scale=torch.tensor(0.5))
>>> found_inf
tensor(1.)
>>> grads[0]
tensor([1., 2.])
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "group_by_device_and_dtype",
    "coalesce_sparse_half_grads_",
    "unscale_and_check_",
    "any_nonfinite",
    "global_norm",
    "dtensor_type",
    "is_dtensor",
    "local_shards",
    "is_flat_shard",
    "cpu_shortcuts",
]


def dtensor_type() -> type | None:
    """``DTensor``, or None before anything imported it (no DTensor can exist then); for
    loops over every parameter that test each one, so the lookup happens once."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(tensor: Any) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor (an FSDP2 parameter or gradient)."""
    cls = dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (sharing its storage), other tensors as they are.

    For copies between tensors that are sharded alike (a parameter and its float32
    master or moving average): ``torch._foreach_copy_`` on the shards is the same copy,
    fused, where torch has no DTensor rule for it.
    """
    cls = dtensor_type()  # looked up once: this runs on every parameter at every step
    if cls is None:
        return list(tensors)
    return [cast("DTensor", t).to_local() if isinstance(t, cls) else t for t in tensors]


def is_flat_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` is (a view of) an FSDP1 flat parameter: this rank's slice of many."""
    return getattr(param, "_fsdp_flattened", False) is True and not is_dtensor(param)


def group_by_device_and_dtype(
    tensors: Iterable[torch.Tensor | None], *, in_place: bool = False
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Group tensors by (device, dtype), dropping ``None`` entries.

    Sparse tensors are represented by their values. For reading (norms, finite
    checks) those are the coalesced values, duplicates summed as they will be. For
    writing (``in_place=True``, an unscale) they are the tensor's own values: the
    coalesced ones are a copy when the tensor is not coalesced, and writing a copy
    would leave the gradient as it was (:func:`coalesce_sparse_half_grads_` first
    makes float16 gradients coalesced, so that their checked values are the summed ones).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            t = t._values() if in_place else t.coalesce()._values()
        groups[(t.device, t.dtype)].append(t)
    return groups


def coalesce_sparse_half_grads_(params: Iterable[torch.Tensor]) -> None:
    """Coalesce the float16 sparse gradients of ``params`` in place (``p.grad``).

    Duplicate indices of a sparse gradient are summed when it is applied; in float16
    that sum of scaled values can overflow where no single value does, so it is made
    (and checked) before unscaling, as ``torch.amp.GradScaler`` does. Other dtypes keep
    their layout: their values are unscaled where they are.
    """
    for p in params:
        g = p.grad
        if g is not None and g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
            p.grad = g.coalesce()


def unscale_and_check_(
    tensors: Iterable[torch.Tensor | None],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multiply ``tensors`` in place by ``inv_scale`` and flag any non-finite value.

    Uses PyTorch's fused ``_amp_foreach_non_finite_check_and_unscale_`` kernel once
    per (device, dtype) group; float16 and bfloat16 tensors are allowed. Returns a
    float32 scalar tensor on ``inv_scale``'s device: 1.0 if any element was inf or
    NaN, else 0.0 (``found_inf`` is accumulated into, if given). No host sync.
    """
    if found_inf is None:
        found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    inv_scale = inv_scale.to(torch.float32)
    for (device, dtype), group in group_by_device_and_dtype(tensors, in_place=True).items():
        if not _fused_kernel_takes(device, dtype):
            found_inf.copy_(torch.maximum(found_inf, _unscale_and_check_foreach_(group, inv_scale)))
        elif device == found_inf.device:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        else:
            # The kernel wants its flag and scale on the tensors' device.
            local_inf = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, local_inf, inv_scale.to(device, non_blocking=True)
            )
            # Flags from several devices add up: keep it a 0/1 flag.
            found_inf.add_(local_inf.to(found_inf.device, non_blocking=True)).clamp_(max=1.0)
    return found_inf


def _fused_kernel_takes(device: torch.device, dtype: torch.dtype) -> bool:
    # The CUDA kernel is built for float32, float64 and float16 only (the CPU one for
    # bfloat16 too).
    return device.type == "cpu" or dtype != torch.bfloat16


def _unscale_and_check_foreach_(group: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """What the fused kernel does, in two foreach passes: a max-abs norm per tensor (an
    inf or NaN element makes it non-finite), then one in-place multiply."""
    device = group[0].device
    found = nonfinite_flag(_largest(torch._foreach_norm(group, float("inf"))))
    torch._foreach_mul_(group, inv_scale.to(device, non_blocking=True))
    return found.to(inv_scale.device, non_blocking=True)


def any_nonfinite(tensors: Iterable[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """1.0 if any element of ``tensors`` is inf or NaN, else 0.0 (float32 on ``device``).

    Reads only: one max-abs norm per (device, dtype) group, no copies. No host sync,
    except on a CPU (:func:`cpu_shortcuts`), which first takes the L2 norms: it computes
    them several times faster than the max-abs ones, finite norms mean finite elements,
    and only a non-finite norm (an inf or NaN, or squares beyond float32's range) sends
    it to the max-abs check; the host read costs a CPU nothing. Written out in one body
    (it runs at every step): :func:`group_by_device_and_dtype`, :func:`_largest` and
    :func:`nonfinite_flag` inline.

    >>> any_nonfinite([torch.ones(2), torch.tensor([float("nan")])], torch.device("cpu"))
    tensor(1.)
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel():
            if t.is_sparse:  # the coalesced values, duplicates summed as they will be
                t = t.coalesce()._values()
            groups.setdefault((t.device, t.dtype), []).append(t)
    peaks = []
    for group in groups.values():
        if group[0].device.type == "cpu" and _get_current_dispatch_mode() is None:  # cpu_shortcuts
            norms = torch._foreach_norm(group, 2)
            if bool((norms[0] if len(norms) == 1 else torch.stack(norms).amax()) < float("inf")):
                peaks.append(torch.zeros((), dtype=group[0].dtype).to(device))
                continue
        norms = torch._foreach_norm(group, float("inf"))
        peaks.append((norms[0] if len(norms) == 1 else torch.stack(norms).amax()).to(device))
    if not peaks:
        return torch.zeros((), dtype=torch.float32, device=device)
    peak = peaks[0] if len(peaks) == 1 else torch.stack(peaks).amax()
    flag = torch.empty((), dtype=torch.float32, device=peak.device)
    return torch.logical_not(peak < float("inf"), out=flag)  # NaN < inf is False


def cpu_shortcuts(device: torch.device) -> bool:
    """Whether work on ``device`` takes the CPU's own ways to the same results: ``device``
    is a CPU and no ``TorchDispatchMode`` watches the ops.

    A CPU computes some results faster another way than a GPU does (an L2 norm before
    the max-abs one, noise drawn masked, a check inside a compiled step), and a host
    read costs it nothing. The results are the same bits either way; only the ops
    differ. Code that watches the ops (a host-sync counter, the step-cost benchmark's
    op counter, a FLOP counter) sees the ops a GPU runs, so what it counts on a CPU is
    what a GPU would do.

    >>> cpu_shortcuts(torch.device("cpu")), cpu_shortcuts(torch.device("meta"))
    (True, False)
    """
    return device.type == "cpu" and _get_current_dispatch_mode() is None


def _largest(values: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The largest of 0-d non-negative ``values`` (NaN if any is NaN): one kernel, none
    for a single value."""
    return values[0] if len(values) == 1 else torch.stack(values).amax()


def nonfinite_flag(value: torch.Tensor) -> torch.Tensor:
    """1.0 if 0-d ``value`` is inf or NaN, else 0.0 (float32): two scalar kernels, where
    ``isfinite`` takes four and a float cast one more.

    >>> nonfinite_flag(torch.tensor(float("nan"))), nonfinite_flag(torch.tensor(3.0))
    (tensor(1.), tensor(0.))
    """
    flag = torch.empty((), dtype=torch.float32, device=value.device)
    return torch.logical_not(value < float("inf"), out=flag)  # NaN < inf is False


def global_norm(
    tensors: Iterable[torch.Tensor | None], device: torch.device | None = None
) -> torch.Tensor:
    """The L2 norm of all ``tensors`` taken together, as a float32 scalar tensor.

    One ``torch._foreach_norm`` per (device, dtype) group, computed in float32 so
    that float16 tensors cannot overflow it. No host sync.
    """
    partial: list[torch.Tensor] = []
    for group in group_by_device_and_dtype(tensors).values():
        # Norms come out in float32, so a float16 gradient with norm > 65504 stays finite.
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        part = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        partial.append(part if device is None else part.to(device, non_blocking=True))
    if not partial:
        return torch.zeros((), dtype=torch.float32, device=device)
    target = partial[0].device if device is None else device
    return torch.linalg.vector_norm(torch.stack([p.to(target) for p in partial]), 2.0)
