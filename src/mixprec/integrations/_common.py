"""What the trainer integrations share: the optional import, the level, the loss scale.

>>> check_level("o2", "bf16", "cpu")
('O2', torch.bfloat16)
>>> level_loss_scale(None, "O2", torch.bfloat16).kind, level_loss_scale(None, "O3", torch.bfloat16).kind
('none', 'none')
>>> require("no_such_library_here", "lightning", "mixprec.integrations.lightning")
Traceback (most recent call last):
...
ImportError: mixprec.integrations.lightning needs the 'no_such_library_here' package, which is not installed: pip install "lightning>=2.6.6,<2.7" (from a mixprec checkout: pip install -e ".[lightning]")
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from mixprec._checks import as_low_precision
from mixprec.amp._auto import choose_auto
from mixprec.amp._level_specs import check_level_name, spec_of
from mixprec.loss_scale import LossScale, loss_scale_from_spec

#: The optional extras of pyproject.toml and the pinned requirements each installs: the
#: install hint names them, so it works whether mixprec came from a checkout or not.
EXTRAS = {
    "lightning": ('"lightning>=2.6.6,<2.7"',),
    "hf": ('"transformers>=5.23,<5.24"', '"accelerate>=1.15,<1.16"'),
}


def require(module: str, extra: str, user: str) -> ModuleType:
    """Import ``module``; if it is missing, ``ImportError`` naming the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{user} needs the {module!r} package, which is not installed: "
            f"pip install {' '.join(EXTRAS[extra])} "
            f'(from a mixprec checkout: pip install -e ".[{extra}]")'
        ) from err


def check_level(level: Any, dtype: Any, device: torch.device | str) -> tuple[str, torch.dtype]:
    """The checked ``(level, dtype)``; ``auto`` decides by ``device`` (``amp.choose_auto``)."""
    normal = check_level_name(level)
    dtype = as_low_precision(dtype, "dtype", hint="the low precision of the level; O0 is float32")
    if spec_of(normal).by_hardware:
        normal, dtype, _ = choose_auto(device)
    return normal, dtype


def level_loss_scale(spec: Any, level: str, dtype: torch.dtype) -> LossScale:
    """The loss scale ``spec`` names, or the level's own (its ``LevelSpec``'s) for ``None``."""
    return spec_of(level).default_loss_scale(dtype) if spec is None else loss_scale_from_spec(spec)


class ScaleReader:
    """A shared loss scale, read as code written for a trainer's ``GradScaler`` reads one:
    to log the scale, watch it fall, or divide scaled gradients by it. Read-only here: the
    optimizers update the scale at each step.

    >>> from mixprec import DynamicLossScale
    >>> reader = ScaleReader(DynamicLossScale(initial_scale=1024.0))
    >>> reader.get_scale(), reader.is_enabled()
    (1024.0, True)
    """

    def __init__(self, loss_scale: LossScale) -> None:
        self.loss_scale = loss_scale

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync)."""
        return float(self.loss_scale.scale)

    @property
    def _scale(self) -> torch.Tensor:
        """The live scale tensor (no sync), as ``GradScaler._scale``."""
        return self.loss_scale.scale

    def is_enabled(self) -> bool:
        return True
