"""Checks of user arguments: numbers, flags, choices, instances, and floating dtypes.

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError``
for a value out of range; the message names the argument, the value received,
what was expected and, where given, how to fix it. A check returns the value
(``int``/``float`` normalised) so it can be used inline.

>>> check_number("lr", 0.1, minimum=0, exclusive=True)
0.1
>>> check_number("steps", 0, integer=True, minimum=1, hint="pass e.g. steps=10")
Traceback (most recent call last):
...
ValueError: steps must be an integer >= 1, got 0; pass e.g. steps=10
>>> check_bool("fused", "yes")
Traceback (most recent call last):
...
TypeError: fused must be True or False, got 'yes'

The one table of floating dtype spellings, and the parsers every layer uses.
----------------------------------------------------------------------------

>>> as_dtype("bf16"), as_dtype(torch.float16), short_name(torch.bfloat16)
(torch.bfloat16, torch.float16, 'bf16')
>>> as_low_precision("half")
torch.float16
>>> as_low_precision(torch.float32)
Traceback (most recent call last):
...
ValueError: dtype must be torch.float16 or torch.bfloat16 (or a name such as 'bf16'), got torch.float32
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, cast

import torch


def _fix(hint: str) -> str:
    return f"; {hint}" if hint else ""


def check_bool(name: str, value: Any, *, hint: str = "") -> bool:
    """``value`` if it is ``True`` or ``False``; else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}{_fix(hint)}")
    return value


def _describe(integer: bool, minimum: Any, maximum: Any, exclusive: bool, none: bool) -> str:
    kind = "an integer" if integer else "a number"
    if minimum == 0 and exclusive and maximum is None:
        text = "a positive integer" if integer else "a positive number"
    elif minimum is not None and maximum is not None:
        low = "(" if exclusive else "["
        text = f"{kind} in {low}{minimum:g}, {maximum:g}]"
    elif minimum is not None:
        text = f"{kind} {'>' if exclusive else '>='} {minimum:g}"
    elif maximum is not None:
        text = f"{kind} <= {maximum:g}"
    else:
        text = f"a finite {'integer' if integer else 'number'}"
    return f"{text} or None" if none else text


def check_number(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive: bool = False,
    allow_none: bool = False,
    hint: str = "",
) -> Any:
    """``value`` as an ``int`` (``integer=True``) or ``float``, checked against the bounds.

    ``minimum`` is exclusive when ``exclusive`` (``minimum=0, exclusive=True``: positive),
    ``maximum`` always inclusive. Non-finite values and ``bool`` are rejected.
    ``allow_none`` lets ``None`` through unchanged.
    """
    if value is None and allow_none:
        return None
    expected = _describe(integer, minimum, maximum, exclusive, allow_none)
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(
            f"{name} must be {expected}, got {value!r} ({type(value).__name__}){_fix(hint)}"
        )
    # ``kind`` is Integral when ``integer``: int() of an Integral is exact.
    number = int(cast(numbers.Integral, value)) if integer else float(value)
    if (
        not math.isfinite(number)
        or (minimum is not None and (number <= minimum if exclusive else number < minimum))
        or (maximum is not None and number > maximum)
    ):
        raise ValueError(f"{name} must be {expected}, got {value!r}{_fix(hint)}")
    return number


def check_choice(name: str, value: Any, choices: Iterable[Any], *, hint: str = "") -> Any:
    """``value`` if it is one of ``choices``; else ``ValueError`` listing them."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}{_fix(hint)}")
    return value


def check_instance(name: str, value: Any, cls: type | tuple[type, ...], what: str, *,
                   hint: str = "") -> Any:
    """``value`` if it is an instance of ``cls`` (described as ``what``); else ``TypeError``."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}{_fix(hint)}")
    return value


#: Every accepted spelling of a floating dtype; the first for each dtype is its short name.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "f16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f64": torch.float64,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}

#: The dtypes that mixed precision computes in.
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

_SHORT: dict[torch.dtype, str] = {}
for _name, _dtype in DTYPE_NAMES.items():
    _SHORT.setdefault(_dtype, _name)

#: Every floating dtype a policy may name.
FLOATING: tuple[torch.dtype, ...] = tuple(_SHORT)


def short_name(dtype: torch.dtype) -> str:
    """The shortest spelling of ``dtype`` (``'f32'``, ``'bf16'``, ...)."""
    return _SHORT[dtype]


def as_dtype(value: Any, what: str = "dtype") -> torch.dtype:
    """``value`` (a floating ``torch.dtype`` or one of its names) as a ``torch.dtype``.

    Names are case-insensitive. ``what`` names the argument in error messages.
    """
    if isinstance(value, torch.dtype):
        if value not in _SHORT:
            raise ValueError(
                f"{what} must be a floating dtype ({', '.join(map(str, FLOATING))}), got {value}"
            )
        return value
    if isinstance(value, str):
        dtype = DTYPE_NAMES.get(value.strip().lower())
        if dtype is None:
            raise ValueError(
                f"{what}: unknown dtype {value!r}; accepted spellings: {', '.join(DTYPE_NAMES)}"
            )
        return dtype
    raise TypeError(
        f"{what} must be a torch.dtype or a dtype name such as 'bf16', "
        f"got {type(value).__name__} {value!r}"
    )


def as_low_precision(value: Any, what: str = "dtype", hint: str = "") -> torch.dtype:
    """``value`` as ``torch.float16`` or ``torch.bfloat16``; anything else is an error."""
    expected = f"{what} must be torch.float16 or torch.bfloat16 (or a name such as 'bf16')"
    fix = f"; {hint}" if hint else ""
    if not isinstance(value, (torch.dtype, str)):
        raise TypeError(f"{expected}, got {value!r} ({type(value).__name__}){fix}")
    try:
        dtype = as_dtype(value, what)
    except ValueError:
        raise ValueError(f"{expected}, got {value!r}{fix}") from None
    if dtype not in LOW_PRECISION:
        raise ValueError(f"{expected}, got {value!r}{fix}")
    return dtype


def low_precision_of(tensors: Any, default: torch.dtype = torch.float16) -> torch.dtype:
    """The first float16/bfloat16 dtype among ``tensors`` (``default`` if there is none).

    >>> low_precision_of([torch.ones(1), torch.ones(1, dtype=torch.bfloat16)])
    torch.bfloat16
    >>> low_precision_of([torch.ones(1)])
    torch.float16
    """
    return next((t.dtype for t in tensors if t.dtype in LOW_PRECISION), default)


#: Accepted spellings of the two float8 formats.
FLOAT8_NAMES: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}


def as_float8_dtype(value: Any, what: str = "fp8_dtype") -> torch.dtype:
    """``value`` (``torch.float8_e4m3fn``/``torch.float8_e5m2`` or a name) as a dtype.

    >>> as_float8_dtype("e5m2")
    torch.float8_e5m2
    """
    if isinstance(value, str) and value.strip().lower() in FLOAT8_NAMES:
        return FLOAT8_NAMES[value.strip().lower()]
    if isinstance(value, torch.dtype) and value in FLOAT8_NAMES.values():
        return value
    raise ValueError(
        f"{what} must be torch.float8_e4m3fn or torch.float8_e5m2 (or a name such as "
        f"'e4m3'), got {value!r}; use 'e4m3' for activations and weights, 'e5m2' for gradients"
    )
