"""The amp levels as data: one frozen :class:`LevelSpec` per level, in :data:`LEVEL_SPECS`.

A level's rules are fields of its spec: how it stores the parameters, how its forward
runs in low precision, its default loss scale per dtype and its default master weights
(what a master-weight mode itself implies, such as the dtype of the optimizer's state,
is its row of :data:`mixprec.optim.masters.MODES`). :func:`~mixprec.amp.initialize`, ``mixprec.Model``,
the command line, the trainer integrations and the level table of the levels guide
(docs/guides/levels.md, checked against :func:`level_table` by the tests) read them
rather than test level names. The guide says what each level is for.

>>> import torch
>>> spec = LEVEL_SPECS["O2"]
>>> spec.storage, spec.master_weights, spec.default_loss_scale(torch.float16).kind
('low_norms_float32', 'fp32', 'dynamic')
>>> LEVEL_SPECS["lean"].alias_of, LEVEL_SPECS["lean"].master_weights
('O3', 'kahan')
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch

from mixprec.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from mixprec.optim.masters import MODES, master_weight_mode, mode_of
from mixprec.optim.masters import MasterWeights as Float32Masters
from mixprec.optim.masters._lean import KAHAN

if TYPE_CHECKING:
    from mixprec.typing import Level, MasterWeights, ModelLevel

#: How a level stores the model's parameters: all float32; in the low dtype but
#: normalisation layers float32; all in the low dtype.
Storage = Literal["float32", "low_norms_float32", "low"]
#: How a level's forward computes: all float32; under ``torch.autocast(device, dtype)``;
#: by mixprec's casts of each region's inputs and parameters; by the fx graph rewrite.
Forward = Literal["float32", "autocast", "casts", "rewrite"]
#: A default loss scale: dynamic scaling, or none (scale 1).
ScaleKind = Literal["dynamic", "none"]

#: The fields a level decided by the hardware (``auto``) leaves ``None``, and every
#: other level sets.
_PER_LEVEL = (
    "storage",
    "forward",
    "float16_loss_scale",
    "bfloat16_loss_scale",
    "master_weights",
)

_CHOICES: dict[str, tuple[str, ...]] = {
    "storage": get_args(Storage),
    "forward": get_args(Forward),
    "float16_loss_scale": get_args(ScaleKind),
    "bfloat16_loss_scale": get_args(ScaleKind),
}


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """What one amp level does, as data; checked when it is made (``ValueError`` naming
    the field).

    A level decided by the hardware (``auto``) leaves every per-level field ``None``:
    :func:`~mixprec.amp.choose_auto` names the concrete level whose spec then applies.

    >>> LevelSpec("O9", storage="low", forward="autocast", float16_loss_scale="dynamic",
    ...           bfloat16_loss_scale="none", master_weights="fp64")
    Traceback (most recent call last):
    ...
    ValueError: LevelSpec 'O9': master_weights must be False or a mode name ..., got 'fp64'
    """

    #: The level's name, as ``level=`` takes it.
    name: str
    #: How the parameters are stored (:data:`Storage`).
    storage: Storage | None
    #: How the forward computes in low precision (:data:`Forward`).
    forward: Forward | None
    #: The loss scale ``loss_scale=None`` gives in float16 (:data:`ScaleKind`).
    float16_loss_scale: ScaleKind | None
    #: The loss scale ``loss_scale=None`` gives in bfloat16: float32's exponent range,
    #: so ``"none"`` at every level (the step still skips an overflow).
    bfloat16_loss_scale: ScaleKind | None
    #: The ``master_weights`` mode ``master_weights=None`` gives (``False``: none).
    master_weights: MasterWeights | None
    #: The level whose storage and casts this one has, with defaults of its own
    #: (``lean`` is O3 with Kahan-compensated updates).
    alias_of: str | None = None
    #: Whether :func:`~mixprec.amp.initialize` takes the level (``False``: the graph
    #: rewrite, a level of ``mixprec.Model`` and the command line).
    amp: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"LevelSpec name must be a non-empty str, got {self.name!r}")
        unset = [name for name in _PER_LEVEL if getattr(self, name) is None]
        if unset and len(unset) < len(_PER_LEVEL):
            raise ValueError(
                f"LevelSpec {self.name!r}: {unset[0]} is None; leave every one of "
                f"{', '.join(_PER_LEVEL)} None (a level decided by the hardware) or none"
            )
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value in choices):
                self._refuse(name, f"one of {', '.join(map(repr, choices))}")
        if self.master_weights is not None:
            try:
                mode = master_weight_mode(self.master_weights)
            except (TypeError, ValueError):
                mode = None
            if mode is None or mode != self.master_weights:  # the canonical spelling only
                self._refuse("master_weights", "False or a mode name (e.g. 'fp32', 'kahan')")
        if self.storage == "float32":
            if self.master_weights:
                self._refuse("master_weights", "False with storage='float32'")
        if self.forward == "float32":
            if self.storage != "float32":
                self._refuse("storage", "'float32' with forward='float32'")
            if "dynamic" in (self.float16_loss_scale, self.bfloat16_loss_scale):
                self._refuse("float16_loss_scale", "'none' with forward='float32'")
        if self.alias_of is not None and (
            not isinstance(self.alias_of, str) or self.alias_of in ("", self.name)
        ):
            self._refuse("alias_of", "None or another level's name")
        if not isinstance(self.amp, bool):
            self._refuse("amp", "True or False")

    def _refuse(self, name: str, expected: str) -> None:
        raise ValueError(
            f"LevelSpec {self.name!r}: {name} must be {expected}, got {getattr(self, name)!r}"
        )

    @property
    def by_hardware(self) -> bool:
        """Whether the hardware decides the level (``auto``: see ``choose_auto``)."""
        return self.storage is None

    @property
    def keep_norms_float32(self) -> bool | None:
        """``keep_batchnorm_fp32``'s default: ``True`` where the level stores normalisation
        layers float32 in a low model, ``False`` where it stores them low, ``None`` where
        every parameter is float32 (O1: ``torch.autocast`` decides how norms compute)."""
        if self.storage in (None, "float32"):
            return None
        return self.storage == "low_norms_float32"

    @property
    def low_precision(self) -> bool:
        """Whether the level computes anything in low precision (every level but O0)."""
        return self.forward != "float32"

    def default_loss_scale(self, dtype: torch.dtype) -> LossScale:
        """The loss scale this level gets in ``dtype`` when none is chosen: the one rule.

        float16 is scaled where :attr:`float16_loss_scale` says (dynamically at O1, O2
        and the rewrite, whose float16 gradients can underflow); bfloat16 has float32's
        exponent range, so it is not scaled (as with ``torch.autocast``): the step then
        checks the gradients for inf and NaN without rewriting them, and still skips a
        step that overflowed. float32 is never scaled.

        >>> import torch
        >>> type(LEVEL_SPECS["O2"].default_loss_scale(torch.float16)).__name__
        'DynamicLossScale'
        >>> [LEVEL_SPECS[n].default_loss_scale(torch.bfloat16).kind for n in ("O1", "O3", "rewrite")]
        ['none', 'none', 'none']
        """
        if self.by_hardware:
            raise ValueError(
                f"level {self.name!r} is decided by the hardware: resolve it first "
                "(mixprec.amp.choose_auto), then ask the level it picks"
            )
        kind = {torch.float16: self.float16_loss_scale, torch.bfloat16: self.bfloat16_loss_scale}
        return DynamicLossScale() if kind.get(dtype) == "dynamic" else NoOpLossScale()


def _check_table(specs: Mapping[str, LevelSpec]) -> None:
    """Raise ``ValueError`` unless the table is keyed by its specs' names and each alias
    names a level with the same storage and casts."""
    for key, spec in specs.items():
        if key != spec.name:
            raise ValueError(f"LEVEL_SPECS[{key!r}] is the spec of {spec.name!r}")
        if spec.alias_of is None:
            continue
        base = specs.get(spec.alias_of)
        if base is None or (base.storage, base.forward) != (spec.storage, spec.forward):
            raise ValueError(
                f"LevelSpec {key!r}: alias_of={spec.alias_of!r} must name a level of the "
                "table with the same storage and forward"
            )


_BY_NAME: dict[str, LevelSpec] = {
    spec.name: spec
    for spec in (
        # name, storage, forward, float16 and bfloat16 loss scale, masters
        LevelSpec("O0", "float32", "float32", "none", "none", False),
        LevelSpec("O1", "float32", "autocast", "dynamic", "none", False),
        LevelSpec("O2", "low_norms_float32", "casts", "dynamic", "none", Float32Masters.mode),
        LevelSpec("O3", "low", "casts", "none", "none", False),
        LevelSpec("lean", "low", "casts", "none", "none", KAHAN, alias_of="O3"),
        LevelSpec("auto", None, None, None, None, None),
        LevelSpec("rewrite", "float32", "rewrite", "dynamic", "none", False, amp=False),
    )
}  # fmt: skip
_check_table(_BY_NAME)

#: Every level, by name, in the order the documentation lists them: the levels of
#: :func:`~mixprec.amp.initialize`, then the graph rewrite's (``mixprec.Model`` and the
#: command line). Read-only.
LEVEL_SPECS = cast("Mapping[ModelLevel, LevelSpec]", types.MappingProxyType(_BY_NAME))

#: The level names :func:`~mixprec.amp.initialize` accepts.
LEVELS = cast("tuple[Level, ...]", tuple(name for name, spec in _BY_NAME.items() if spec.amp))

#: The spellings :func:`check_level_name` takes, lower-cased, to the canonical ones.
_SPELLINGS = {name.lower(): name for name in LEVELS}


def check_level_name(level: Any) -> Level:
    """``level`` checked and normalised (``"o2"`` -> ``"O2"``); a clear error otherwise.

    >>> check_level_name(" o2 "), check_level_name("LEAN")
    ('O2', 'lean')
    """
    if not isinstance(level, str):
        raise TypeError(
            f"level must be a str, one of {LEVELS}, got {type(level).__name__} {level!r}"
        )
    normal = _SPELLINGS.get(level.strip().lower())
    if normal is None:
        other = _BY_NAME.get(level.strip().lower())
        hint = ("; the graph rewrite is mixprec.rewrite.rewrite(model, example_inputs, dtype)"
                if other is not None and other.forward == "rewrite" else "")  # fmt: skip
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}{hint}")
    return cast("Level", normal)


def spec_of(level: str) -> LevelSpec:
    """The spec of ``level``, a canonical name of :data:`LEVEL_SPECS` (``ValueError`` else).

    >>> spec_of("O3").storage
    'low'
    """
    spec = _BY_NAME.get(level)
    if spec is None:
        raise ValueError(f"level must be one of {', '.join(_BY_NAME)}, got {level!r}")
    return spec


def default_loss_scale(level: str, dtype: torch.dtype) -> LossScale:
    """The loss scale ``level`` gets in ``dtype`` when none is chosen
    (:meth:`LevelSpec.default_loss_scale` of its spec).

    >>> import torch
    >>> default_loss_scale("O1", torch.float16).kind, default_loss_scale("O3", torch.float16).kind
    ('dynamic', 'none')
    """
    return spec_of(level).default_loss_scale(dtype)


def level_master_weights(level: str) -> MasterWeights:
    """The ``master_weights`` mode ``level`` uses by default.

    >>> level_master_weights("O2"), level_master_weights("lean"), level_master_weights("O3")
    ('fp32', 'kahan', False)
    """
    mode = spec_of(level).master_weights
    return False if mode is None else mode


def float16_optimizer_state(level: str, dtype: torch.dtype, masters: Any) -> bool:
    """Whether ``level`` in ``dtype`` with master-weight mode ``masters`` (as
    :func:`check_master_weights` returns it) keeps the optimizer's state (Adam's moments)
    in float16: the level stores parameters in float16 and the mode steps them itself
    (the registry's ``state_in_parameter_dtype``: no masters, kahan), as at O3, lean and
    O2 without masters. Adam's default ``eps=1e-8`` is below float16's range there.

    >>> float16_optimizer_state("O3", torch.float16, False), float16_optimizer_state("O2", torch.float16, "fp32")
    (True, False)
    >>> float16_optimizer_state("O2", torch.float16, "kahan"), float16_optimizer_state("O3", torch.float16, "fp32")
    (True, False)
    """
    if dtype != torch.float16 or spec_of(level).storage in (None, "float32"):
        return False
    return mode_of(masters).state_in_parameter_dtype


def check_master_weights(value: MasterWeights | None, level: Level, dtype: torch.dtype) -> MasterWeights:
    """The ``master_weights`` mode for ``level``: its default for ``None``, else checked.

    >>> check_master_weights(None, "O2", torch.bfloat16), check_master_weights("split8", "O2", torch.bfloat16)
    ('fp32', 'split8')
    """
    if value is None:
        return level_master_weights(level)
    mode = master_weight_mode(value)
    if mode and spec_of(level).storage == "float32":
        raise ValueError(
            f"master_weights={value!r} with level={level!r}: {level} keeps every parameter in "
            "float32, so there is nothing to keep masters of; use O2, O3 or lean"
        )
    if dtype in (torch.float16, torch.bfloat16) and dtype not in mode_of(mode).dtypes:
        takes = "/".join(repr(row.name) for row in MODES.values() if row.name != "none"
                         and dtype in row.dtypes)  # fmt: skip
        raise ValueError(
            f"master_weights={value!r} works on bfloat16 parameters, got dtype={dtype}; "
            f"use dtype=torch.bfloat16, or master_weights={takes} for float16"
        )
    return cast("MasterWeights", mode)  # one of the modes master_weight_mode checked


# -- the level table of the docs ----------------------------------------------------------

_STORAGE_TEXT = {
    "float32": "float32",
    "low_norms_float32": "low, normalisation layers float32",
    "low": "low, everything",
}
_FORWARD_TEXT = {
    "float32": "float32",
    "autocast": "`torch.autocast(device)` itself: that device's own op lists",
    "casts": "low",
    "rewrite": "the graph rewrite's allow / deny lists (parameters cast in the graph)",
}


def _steps_text(spec: LevelSpec) -> str:
    if spec.storage == "float32":
        return "float32"
    if not spec.master_weights:
        return "the low-precision weights"
    return mode_of(spec.master_weights).summary


def _loss_scale_text(spec: LevelSpec) -> str:
    scaled = [low for low, kind in (("float16", spec.float16_loss_scale),
                                    ("bfloat16", spec.bfloat16_loss_scale)) if kind == "dynamic"]  # fmt: skip
    if not scaled:
        return "none"
    return "dynamic" if len(scaled) == 2 else f"dynamic for {scaled[0]}"


def level_table() -> str:
    """The level table of the levels guide, in Markdown, rendered from :data:`LEVEL_SPECS`.

    >>> print(level_table().splitlines()[2])
    | `O0` | float32 | float32 | float32 | none |
    """
    rows = [
        "| level | parameters | compute | optimizer steps | default loss scale |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in LEVEL_SPECS.values():
        name = f"`{spec.name}`" + ("" if spec.amp else " (`Model`, `mixprec train`)")
        if spec.by_hardware:
            rows.append(f"| {name} | picked by the hardware | | | |")
            continue
        storage = _STORAGE_TEXT[str(spec.storage)]
        if spec.alias_of is not None:
            storage += f" ({spec.alias_of}'s casts)"
        cells = (storage, _FORWARD_TEXT[str(spec.forward)], _steps_text(spec),
                 _loss_scale_text(spec))  # fmt: skip
        rows.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(rows)
