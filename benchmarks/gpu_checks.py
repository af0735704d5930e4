"""The checks of :mod:`benchmarks.gpu` beside the timings: host syncs and a kernel profile.

Both use the O2 recipe of :func:`benchmarks.recipes.build_recipe` on the benchmark's
workload, each on fresh weights. On a CPU the sync check counts syncs with
mixprec's ``HostSyncCounter`` and the profile ranks CPU operators, so both run
(and are tested) without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu_measure import Workload, free_memory, one_line
from benchmarks.recipes import build_recipe

__all__ = ["host_sync_check", "kernel_profile"]


def _on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


@contextlib.contextmanager
def _no_host_syncs(cuda: bool, found: list[str]) -> Iterator[None]:
    """CUDA: every host sync inside raises. CPU: syncs are counted into ``found``."""
    if cuda:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    from mixprec.tools._syncs import HostSyncCounter

    with HostSyncCounter() as counter:
        yield
    found.extend(counter.events)


def host_sync_check(work: Workload, warmup: int = 2, steps: int = 5) -> dict[str, Any]:
    """O2 float16 with fused AdamW: ``steps`` steps after ``warmup``, each host sync an error.

    Two scopes, each on a fresh recipe: the whole step (forward, float32 loss,
    scaled backward, optimizer step) and the optimizer step alone. On a CPU,
    where ``set_sync_debug_mode`` does not exist, mixprec's ``HostSyncCounter``
    counts the scalar reads and device-to-host copies of the same steps instead.
    """
    cuda = _on_cuda(work.device)
    result: dict[str, Any] = {
        "recipe": "O2 fp16, AdamW(fused=True)",
        "warmup": warmup,
        "steps": steps,
        "mode": 'torch.cuda.set_sync_debug_mode("error")' if cuda else "HostSyncCounter (CPU)",
    }
    for scope in ("whole step", "optimizer step"):
        recipe = build_recipe("O2", work.model, work.x, work.device, torch.float16)
        opt = recipe.optimizer
        for _ in range(warmup):
            recipe.step(work.x, work.y)
        found: list[str] = []
        whole = scope == "whole step"
        try:
            for _ in range(steps):
                with _no_host_syncs(cuda, found) if whole else contextlib.nullcontext():
                    loss = F.cross_entropy(recipe.model(work.x).float(), work.y)
                    opt.scale_loss(loss).backward()
                    with contextlib.nullcontext() if whole else _no_host_syncs(cuda, found):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
        except Exception as err:  # the debug mode's RuntimeError names the syncing call
            result[scope] = {"passed": False, "error": one_line(err)}
        else:
            error = f"{len(found)} host syncs: {', '.join(found[:3])}" if found else None
            result[scope] = {"passed": not found, "error": error}
        del recipe, opt
        free_memory(work.device)
    return result


def kernel_profile(work: Workload, steps: int = 3, top: int = 10) -> dict[str, Any]:
    """``torch.profiler`` over ``steps`` O2 bfloat16 eager steps: the ``top`` kernels by time.

    CUDA: the GPU kernels by self device time. CPU: the operators by self CPU time.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = _on_cuda(work.device)
    recipe = build_recipe("O2", work.model, work.x, work.device, torch.bfloat16)
    for _ in range(2):
        recipe.step(work.x, work.y)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            recipe.step(work.x, work.y)
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = [e for e in averages if e.device_type == kind]
    total = sum(getattr(e, key) for e in kernels) or 1.0
    ranked = sorted(kernels, key=lambda e: getattr(e, key), reverse=True)[:top]
    del recipe
    free_memory(work.device)
    return {
        "recipe": "O2 bf16 eager",
        "steps": steps,
        "time": "GPU kernels, self CUDA time" if cuda else "CPU operators, self CPU time",
        "total_ms_per_step": total / 1e3 / steps,
        "top": [
            {
                "name": e.key,
                "ms_per_step": getattr(e, key) / 1e3 / steps,
                "share": getattr(e, key) / total,
                "calls_per_step": e.count / steps,
            }
            for e in ranked
        ],
        "torch_table": averages.table(sort_by=key, row_limit=top, max_name_column_width=60),
    }
