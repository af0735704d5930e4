"""Count host-device synchronisations made by a block of code.

A host sync is any point where Python waits for the device to hand back a value:
``tensor.item()``, ``bool(tensor)``, ``float(tensor)``, ``if tensor:``, or a copy
from an accelerator to the CPU. All of those reach the dispatcher as
``aten._local_scalar_dense`` (the scalar reads) or as a copy whose source is an
accelerator and whose destination is the CPU. :class:`HostSyncCounter` counts them
with a ``TorchDispatchMode``, so it works on CPU too, where a "sync" costs nothing
but is still the place that would stall a GPU. While it counts, CPU-only host reads
that a GPU run does not make are off, as under any dispatch mode
(:func:`~mixprec.numerics.cpu_shortcuts`).

>>> import torch
>>> x = torch.ones(3)
>>> with HostSyncCounter() as syncs:
...     y = x * 2           # no sync
...     v = y.sum().item()  # one sync
>>> syncs.count
1
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _device_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func not in _COPIES:
        return False
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    src = args[0]
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == "cpu" and src.device.type != "cpu"


class HostSyncCounter(TorchDispatchMode):
    """Context manager counting scalar reads and device-to-host copies (``.count``).

    ``.events`` lists the ops seen, for a readable failure message.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.events: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _SCALAR_READS or _device_to_host(func, args, kwargs):
            self.count += 1
            self.events.append(str(func))
        return func(*args, **kwargs)
