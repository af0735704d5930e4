"""The master-weight modes, a row each: what ``master_weights=`` accepts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from mixprec._checks import check_choice
from mixprec.optim.masters._float32 import MasterWeights
from mixprec.optim.masters._lean import KAHAN, STOCHASTIC, LeanUpdates
from mixprec.optim.masters._plain import ModelParameters
from mixprec.optim.masters._protocol import Masters
from mixprec.optim.masters._split import Split8MasterWeights, SplitMasterWeights

if TYPE_CHECKING:
    from mixprec.typing import MasterWeights as MasterWeightsOption


@dataclasses.dataclass(frozen=True)
class MasterMode:
    """One master-weight mode: its name, what it needs, what it costs, how it is built.

    >>> MODES["split8"].bytes_per_parameter, MODES["split8"].fused
    (11.0, True)
    """

    #: The value of ``master_weights=`` (``"none"`` is ``False``).
    name: str
    #: What the optimizer steps, in words (the docs' level table).
    summary: str
    #: What it reports as ``LossScaleOptimizer.master_weights``.
    option: bool | str
    #: The parameters it takes, in words (its ``check`` refuses the others).
    needs: str
    #: Bytes per parameter at rest with ``torch.optim.AdamW``, the parameter included
    #: (bfloat16 parameters; ``"none"``: moments in the parameters' dtype).
    bytes_per_parameter: float
    #: Whether it has a fused AdamW step (docs/guides/master-weights.md).
    fused: bool
    #: Whether ``use_ema=True`` works with it (float32 masters that live between steps).
    ema: bool
    #: Whether :class:`~mixprec.optim.GradientRelease` steps it.
    release: bool
    #: The low-precision dtypes of the parameters it takes.
    dtypes: tuple[torch.dtype, ...]
    #: Whether the inner optimizer steps the low-precision parameters themselves, so that
    #: its state (Adam's moments) is kept in their dtype: then, in float16, an ``eps``
    #: below float16's smallest normal number turns the first step's weights NaN.
    state_in_parameter_dtype: bool
    #: Raise ``ValueError`` unless the mode can take the optimizer's parameters.
    check: Callable[[torch.optim.Optimizer], None]
    #: Build the mode on an optimizer (its low-precision parameters are taken over).
    build: Callable[[torch.optim.Optimizer], Masters]

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if not self.bytes_per_parameter > 0:
            raise ValueError(
                f"bytes_per_parameter must be positive, got {self.bytes_per_parameter!r}"
            )
        if not (callable(self.check) and callable(self.build)):
            raise TypeError(f"mode {self.name!r}: check and build must be callables")
        if not self.dtypes or not set(self.dtypes) <= {torch.float16, torch.bfloat16}:
            raise ValueError(
                f"mode {self.name!r}: dtypes must name float16 and/or bfloat16, got {self.dtypes!r}"
            )


_BOTH = (torch.float16, torch.bfloat16)
_BF16 = (torch.bfloat16,)

MODES: dict[str, MasterMode] = {
    row.name: row
    for row in (
        MasterMode("none", "the low-precision weights",
                   False, "any parameters", 6.0, fused=False, ema=True, release=True,
                   dtypes=_BOTH, state_in_parameter_dtype=True,
                   check=ModelParameters.check, build=ModelParameters),
        MasterMode(MasterWeights.mode, "float32 master weights",
                   True, "float16 or bfloat16 parameters", 14.0, fused=True, ema=True,
                   release=True, dtypes=_BOTH, state_in_parameter_dtype=False,
                   check=MasterWeights.check, build=MasterWeights),
        MasterMode(SplitMasterWeights.mode, "float32 masters rebuilt from the weight and 16 bits",
                   SplitMasterWeights.option, "plain bfloat16 parameters", 12.125, fused=False,
                   ema=False, release=True, dtypes=_BF16, state_in_parameter_dtype=False,
                   check=SplitMasterWeights.check, build=SplitMasterWeights),
        MasterMode(Split8MasterWeights.mode, "float32 masters rebuilt from the weight and 8 bits",
                   Split8MasterWeights.option, "plain bfloat16 parameters", 11.0, fused=True,
                   ema=False, release=True, dtypes=_BF16, state_in_parameter_dtype=False,
                   check=Split8MasterWeights.check, build=Split8MasterWeights),
        MasterMode(KAHAN, "Kahan-compensated updates",
                   KAHAN, "float16 or bfloat16 parameters", 8.0, fused=True,
                   ema=True, release=False, dtypes=_BOTH, state_in_parameter_dtype=True,
                   check=functools.partial(LeanUpdates.check, mode=KAHAN),
                   build=functools.partial(LeanUpdates, mode=KAHAN)),
        MasterMode(STOCHASTIC, "stochastically rounded updates",
                   STOCHASTIC, "bfloat16 parameters", 6.0, fused=True,
                   ema=True, release=False, dtypes=_BF16, state_in_parameter_dtype=True,
                   check=functools.partial(LeanUpdates.check, mode=STOCHASTIC),
                   build=functools.partial(LeanUpdates, mode=STOCHASTIC)),
    )
}  # fmt: skip

#: The values ``master_weights=`` accepts besides ``True`` (``"fp32"``).
MASTER_WEIGHT_MODES: tuple[bool | str, ...] = (False, *(n for n in MODES if n != "none"))


def master_weight_mode(value: Any) -> MasterWeightsOption:
    """Normalise ``master_weights=``: ``True`` means ``"fp32"``; raise on anything else.

    >>> master_weight_mode(True), master_weight_mode("kahan"), master_weight_mode(False)
    ('fp32', 'kahan', False)
    """
    if value is True:
        return cast("MasterWeightsOption", MasterWeights.mode)
    if not isinstance(value, (bool, str)):
        names = ", ".join(repr(n) for n in MASTER_WEIGHT_MODES if n)
        raise TypeError(
            f"master_weights must be True, False or one of {names}, "
            f"got {type(value).__name__} {value!r}"
        )
    return cast("MasterWeightsOption", check_choice(
        "master_weights", value, MASTER_WEIGHT_MODES,
        hint="the README's lean training section says what each costs"))  # fmt: skip


def mode_of(master_weights: Any) -> MasterMode:
    """The registry's row for a ``master_weights=`` value (checked).

    >>> mode_of(False).name, mode_of(True).name
    ('none', 'fp32')
    """
    mode = master_weight_mode(master_weights)
    return MODES[mode if isinstance(mode, str) else "none"]


def build_masters(inner_optimizer: torch.optim.Optimizer, master_weights: Any) -> Masters:
    """The :class:`Masters` that owns what ``inner_optimizer`` steps, by ``master_weights``."""
    return mode_of(master_weights).build(inner_optimizer)
