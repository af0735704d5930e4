"""Argument validation shared by every layer: one wording for every bad value.

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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["check_bool", "check_number", "check_choice", "check_instance"]


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
    number = int(value) if integer else float(value)
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
