"""Type aliases for the values mixprec's public functions accept, for type checkers.

Each alias names the canonical spellings that the function checks at run time, so
that a type checker rejects a misspelt option before the code runs::

    from mixprec import amp
    amp.initialize(net, opt, level="O7")     # mypy: incompatible type "Literal['O7']"

* :data:`Level` - an amp level of :func:`mixprec.amp.initialize`: ``"O0"``-``"O3"``,
  ``"lean"`` or ``"auto"`` (``mixprec.amp.LEVELS``). The run-time check also takes
  other cases and spaces (``"o2"``); the alias names the canonical spellings.
* :data:`ModelLevel` - a :class:`mixprec.Model` ``amp_level``: a :data:`Level`, or
  ``"rewrite"`` (the graph rewrite).
* :data:`DTypeName` - a name of a floating dtype (``"bf16"``, ``"float32"``, ``"half"``...;
  the spellings of ``mixprec._checks.DTYPE_NAMES``, matched case-insensitively at run time).
* :data:`LowPrecision` - the low precision of a level: ``torch.float16``,
  ``torch.bfloat16``, or one of their names (``"fp16"``, ``"bf16"``...).
* :data:`LossScaleSpec` - a loss scale: ``"dynamic"``, ``"none"``/``None`` (no scaling),
  a positive number (a fixed scale) or a :class:`mixprec.LossScale`
  (:func:`mixprec.loss_scale_from_spec`; ``amp.initialize`` reads ``None`` as the
  level's default).
* :data:`MasterWeights` - what the optimizer steps for low-precision parameters:
  ``True``/``"fp32"`` (float32 masters), ``"split"``, ``"split8"``, ``"kahan"``, ``"stochastic"``,
  or ``False`` (the parameters themselves).
* :data:`Float8Recipe` - ``fp8=`` of ``amp.initialize``: ``True``/``"dynamic"``,
  ``"delayed"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, or ``False``/``None`` (no float8).

``import mixprec.typing`` imports neither torch nor the rest of mixprec: ``torch.dtype``
and ``LossScale`` appear in the aliases as forward references (strings), which type
checkers resolve and ``typing.get_type_hints`` resolves in any module that imports them.

>>> from typing import get_args
>>> get_args(Level)
('O0', 'O1', 'O2', 'O3', 'lean', 'auto')
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias, Union

if TYPE_CHECKING:
    import torch

    from mixprec.loss_scale import LossScale

__all__ = [
    "Level",
    "ModelLevel",
    "DTypeName",
    "LowPrecision",
    "LossScaleSpec",
    "MasterWeights",
    "Float8Recipe",
]

# The aliases are run-time objects too. Those naming torch.dtype or LossScale spell them
# as strings inside Union[...], since `"LossScale" | float` is not valid at run time.

#: An amp level of ``mixprec.amp.initialize`` (``mixprec.amp.LEVELS``).
Level: TypeAlias = Literal["O0", "O1", "O2", "O3", "lean", "auto"]

#: A ``mixprec.Model`` ``amp_level``: an amp level or the graph rewrite.
ModelLevel: TypeAlias = Level | Literal["rewrite"]

#: A floating dtype's name (``mixprec._checks.DTYPE_NAMES``).
DTypeName: TypeAlias = Literal[
    "f32", "fp32", "float32", "float",
    "f16", "fp16", "float16", "half",
    "bf16", "bfloat16",
    "f64", "fp64", "float64", "double",
]  # fmt: skip

#: ``torch.float16``, ``torch.bfloat16`` or one of their names.
LowPrecision: TypeAlias = Union[
    "torch.dtype", Literal["f16", "fp16", "float16", "half", "bf16", "bfloat16"]
]

#: A loss scale (``mixprec.loss_scale_from_spec``): a kind, a fixed number, ``None`` or an object.
LossScaleSpec: TypeAlias = Union[Literal["dynamic", "none"], float, int, None, "LossScale"]

#: A master-weight mode's name (``mixprec.optim.masters.MODES``).
MasterWeightsMode: TypeAlias = Literal["fp32", "split", "split8", "kahan", "stochastic"]

#: ``master_weights=``: a mode's name, ``True`` (``"fp32"``) or ``False`` (none).
MasterWeights: TypeAlias = bool | MasterWeightsMode

#: A float8 recipe's name (``mixprec.float8``: tensorwise dynamic or delayed scales, or
#: per-row scales, with or without a high-precision weight gradient).
Float8RecipeName: TypeAlias = Literal["dynamic", "delayed", "rowwise", "rowwise_with_gw_hp"]

#: ``fp8=`` of ``amp.initialize`` (``mixprec.amp._initialize.check_fp8``; ``True`` is
#: ``"dynamic"``, ``None``/``False`` no float8).
Float8Recipe: TypeAlias = bool | Float8RecipeName | None
