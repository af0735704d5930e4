"""``auto``: the amp level and low precision the hardware calls for, and why.

On CUDA, O2: bfloat16 at compute capability 8.0 or above, else float16 with a dynamic
loss scale. On a CPU with bfloat16 units, O1 in bfloat16 (``torch.autocast("cpu",
torch.bfloat16)``); on any other CPU, O0 (float32): emulated bfloat16 matmuls are far
slower than float32 ones.

>>> import torch
>>> level, dtype, reason = choose_auto("cpu")
>>> (level, dtype) in (("O1", torch.bfloat16), ("O0", torch.float32))
True
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Final

import torch
from torch import nn

from mixprec.amp._level_specs import spec_of

if TYPE_CHECKING:
    from mixprec.typing import Level

_log = logging.getLogger("mixprec.amp")

# What "auto" means on a CPU, decided by measurement (AVX512-BF16 CPU, one thread,
# 4-layer transformer encoder d=512, 8 heads, seq 128, batch 8, forward + backward +
# AdamW step, CPU time as a fraction of float32's, several runs): O2 bf16 0.36-0.37,
# torch.autocast bf16 0.35-0.36, which O1 now is. O2 keeps weights and activations
# in bf16 and pays the float32 norm boundaries and the master-weight copies.
_CPU_AUTO_LEVEL: Final = "O1"


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


def choose_auto(device: torch.device | str) -> tuple[Level, torch.dtype, str]:
    """``(level, dtype, reason)``: what ``auto`` picks on ``device`` (see the module), and why.

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


def resolve_level(model: nn.Module, level: Level, dtype: torch.dtype) -> tuple[Level, torch.dtype]:
    """The concrete ``(level, dtype)`` that ``level`` means for ``model`` (``auto`` decides)."""
    if not spec_of(level).by_hardware:
        return level, dtype
    level, dtype, reason = choose_auto(_model_device(model))
    _log.info("auto: level %s, %s: %s", level, dtype, reason)
    return level, dtype

