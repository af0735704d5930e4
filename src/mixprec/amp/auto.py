"""``auto``: the amp level and low precision the hardware calls for, and why.

>>> import torch
>>> level, dtype, reason = choose_auto("cpu")
>>> (level, dtype) in (("O1", torch.bfloat16), ("O0", torch.float32))
True
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

__all__ = ["choose_auto", "cpu_has_fast", "resolve_level"]

_log = logging.getLogger("mixprec.amp")

# What "auto" means on a CPU, decided by measurement (AVX512-BF16 CPU, one thread,
# 4-layer transformer encoder d=512, 8 heads, seq 128, batch 8, forward + backward +
# AdamW step, CPU time as a fraction of float32's, several runs): O2 bf16 0.36-0.37,
# O1 bf16 0.38-0.40, torch.autocast bf16 0.35-0.36. O1 casts every activation into
# and out of each allow-listed layer; O2 keeps weights and activations in bf16 and
# pays only the float32 norm boundaries and the master-weight copies.
_CPU_AUTO_LEVEL = "O1"


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def cpu_has_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU has ``dtype`` units, by oneDNN's check (else, e.g. AVX2 only, its
    matmuls are emulated ~100x slower than float32).

    >>> cpu_has_fast(torch.bfloat16) in (True, False)
    True
    """
    name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    try:
        return bool(getattr(torch.ops.mkldnn, name[dtype])())
    except (KeyError, AttributeError, RuntimeError):  # no such check in this build: no units
        return False


def choose_auto(device: torch.device | str) -> tuple[str, torch.dtype, str]:
    """``(level, dtype, reason)``: what ``auto`` picks on ``device`` (table above), and why.

    >>> level, dtype, reason = choose_auto("cpu")
    >>> (level, dtype) in (("O1", torch.bfloat16), ("O0", torch.float32))
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        cap = "{}.{}".format(*torch.cuda.get_device_capability(device))
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return "O2", torch.bfloat16, f"CUDA compute capability {cap} >= 8.0: bfloat16 units"
        why = f"CUDA compute capability {cap} < 8.0: no bfloat16 units, float16 + loss scaling"
        return "O2", torch.float16, why
    if device.type != "cpu":
        return "O0", torch.float32, f"no known fast low precision on {device.type}: float32"
    if cpu_has_fast(torch.bfloat16):
        return _CPU_AUTO_LEVEL, torch.bfloat16, "this CPU has bfloat16 units"
    why = "this CPU has no bfloat16 units: bfloat16 would be emulated, far slower than float32"
    return "O0", torch.float32, why


def resolve_level(model: nn.Module, level: str, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """The concrete ``(level, dtype)`` that ``level`` means for ``model`` (``auto`` decides)."""
    if level != "auto":
        return level, dtype
    level, dtype, reason = choose_auto(_model_device(model))
    _log.info("auto: level %s, %s: %s", level, dtype, reason)
    return level, dtype
