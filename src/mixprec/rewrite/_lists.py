"""The four op lists (Allow, Infer, Deny, Clear) and the precision levels of the rewrite.

Naming: a list names an op by its *short name*, the ATen operator packet name
without namespace or overload: ``torch.ops.aten.addmm.default`` is ``"addmm"``,
``torch.ops.aten.softmax.int`` is ``"softmax"``. In-place variants share the name
of their out-of-place op (``relu_`` is ``"relu"``). Graphs captured without
``torch.export`` use the same names: ``F.linear`` and ``nn.Linear`` are
``"linear"``, ``operator.add`` is ``"add"``, ``nn.BatchNorm2d`` is ``"batch_norm"``,
``x.view(...)`` is ``"view"``. :func:`normalize_op_name` also accepts the spellings
``"aten.addmm"``, ``"aten::addmm"``, ``"torch.ops.aten.addmm.default"``.

The lists, after the classic auto-mixed-precision lists (defaults, with the
reasons for each entry, in :mod:`mixprec.rewrite._defaults`):

* Allow: numerically safe and much faster in low precision; always converted.
* Deny: numerically unsafe in low precision (exponentials, reductions, losses,
  normalisation statistics); always float32, and their float32-ness spreads
  forward through Infer ops.
* Infer: safe in low precision unless fed by a Deny op; they follow their inputs.
* Clear: no numerical effect (data movement, selection, sign); they take the
  precision of their neighbours.

Environment overrides, applied by :meth:`AmpLists.with_env` (and by every
rewrite): ``MIXPREC_{ALLOW,INFER,DENY,CLEAR}LIST_{ADD,REMOVE}``, each a
comma-separated list of op names. Removals are applied before additions, so
``MIXPREC_DENYLIST_REMOVE=softmax MIXPREC_INFERLIST_ADD=softmax`` moves softmax.

>>> lists = AmpLists()
>>> lists.list_of("addmm"), lists.list_of("softmax"), lists.list_of("view")
('allow', 'deny', 'clear')
>>> lists.remove("deny", "softmax").add("infer", "softmax").list_of("softmax")
'infer'
>>> lists.add("allow", "softmax")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: op 'softmax' would be in both the allow list and the infer list; ...
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping

import torch

from mixprec.rewrite._defaults import ALLOW, CLEAR, DENY, INFER

LIST_NAMES = ("allow", "infer", "deny", "clear")

PAINT_LEVELS = {
    "default": "the painting algorithm with all four lists",
    "treat_infer_as_deny": "Infer ops are treated as Deny ops: only Allow ops and the "
    "Clear ops around them change precision",
    "allow_only": "only Allow ops change precision; every other op stays float32",
    "unsafe_force_all": "every float32 op changes precision, whatever its list "
    "(numerically unsafe; for experiments)",
}

_DEFAULTS = {"allow": ALLOW, "infer": INFER, "deny": DENY, "clear": CLEAR}
_ALL_DEFAULT_NAMES = frozenset().union(*_DEFAULTS.values())
# Names that graphs captured without torch.export use and that have no ATen packet.
_EXTRA_NAMES = frozenset({"getitem", "concat", "multihead_attention", "embedding"})


def normalize_op_name(name: str) -> str:
    """Return the short op name for one of its accepted spellings.

    >>> normalize_op_name("torch.ops.aten.addmm.default"), normalize_op_name("aten::relu_")
    ('addmm', 'relu')
    """
    if not isinstance(name, str):
        raise TypeError(f"op names must be strings, got {name!r} ({type(name).__name__})")
    short = name.strip()
    for prefix in ("torch.ops.aten.", "aten::", "aten."):
        if short.startswith(prefix):
            short = short[len(prefix) :]
            # An overload name may follow: "addmm.default" -> "addmm".
            short = short.split(".", 1)[0]
            break
    if short.endswith("_") and not short.endswith("__") and len(short) > 1:
        short = short[:-1]
    return short


def _is_known(name: str) -> bool:
    if name in _ALL_DEFAULT_NAMES or name in _EXTRA_NAMES:
        return True
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _check_known(names: Iterable[str], where: str) -> list[str]:
    checked = []
    for raw in names:
        name = normalize_op_name(raw)
        if not name or not _is_known(name):
            close = difflib.get_close_matches(name, sorted(_ALL_DEFAULT_NAMES), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"unknown op name {raw!r} in {where}: expected the short name of an ATen "
                f"op such as 'addmm', 'softmax' or 'view'{hint}"
            )
        checked.append(name)
    return checked


def _check_list_name(list_name: str) -> str:
    if list_name not in LIST_NAMES:
        raise ValueError(f"list_name must be one of {LIST_NAMES}, got {list_name!r}")
    return list_name


def check_level(level: str) -> str:
    """Return ``level`` if it names a precision level, else raise ``ValueError``.

    >>> check_level("allow_only")
    'allow_only'
    """
    if level not in PAINT_LEVELS:
        accepted = ", ".join(f"{name!r} ({what})" for name, what in PAINT_LEVELS.items())
        raise ValueError(f"unknown level {level!r}; accepted levels: {accepted}")
    return level


class AmpLists:
    """Four disjoint sets of op names: ``allow``, ``infer``, ``deny``, ``clear``.

    Built from the defaults of this module unless a list is given. :meth:`add` and
    :meth:`remove` edit one list in place and return ``self`` (so calls chain);
    every edit is validated first and leaves the lists unchanged when rejected:
    unknown op names and an op in two lists raise ``ValueError``.

    >>> lists = AmpLists(deny=["softmax", "log_softmax"])
    >>> sorted(lists.deny)
    ['log_softmax', 'softmax']
    >>> AmpLists().add("clear", "embedding").list_of("embedding")
    'clear'
    """

    def __init__(
        self,
        allow: Iterable[str] | None = None,
        infer: Iterable[str] | None = None,
        deny: Iterable[str] | None = None,
        clear: Iterable[str] | None = None,
    ) -> None:
        given = {"allow": allow, "infer": infer, "deny": deny, "clear": clear}
        sets: dict[str, set[str]] = {}
        for list_name, names in given.items():
            if names is None:
                sets[list_name] = set(_DEFAULTS[list_name])
            elif isinstance(names, str):
                raise TypeError(
                    f"{list_name} must be an iterable of op names, got the string {names!r}; "
                    f"write {list_name}=[{names!r}]"
                )
            else:
                sets[list_name] = set(_check_known(names, f"the {list_name} list"))
        _check_disjoint(sets)
        self._sets = sets

    @property
    def allow(self) -> frozenset[str]:
        """Ops always converted to low precision."""
        return frozenset(self._sets["allow"])

    @property
    def infer(self) -> frozenset[str]:
        """Ops that follow their inputs unless fed by a Deny op."""
        return frozenset(self._sets["infer"])

    @property
    def deny(self) -> frozenset[str]:
        """Ops that always stay float32."""
        return frozenset(self._sets["deny"])

    @property
    def clear(self) -> frozenset[str]:
        """Ops with no numerical effect that take their neighbours' precision."""
        return frozenset(self._sets["clear"])

    def list_of(self, op: str) -> str | None:
        """Name of the list holding ``op`` (``None`` when it is on none)."""
        op = normalize_op_name(op)
        for list_name in LIST_NAMES:
            if op in self._sets[list_name]:
                return list_name
        return None

    def add(self, list_name: str, *ops: str) -> AmpLists:
        """Add ``ops`` to ``list_name``; an op already on another list is an error."""
        names = _check_known(ops, f"AmpLists.add({list_name!r}, ...)")
        trial = self._copy_sets()
        trial[_check_list_name(list_name)].update(names)
        _check_disjoint(trial)
        self._sets = trial
        return self

    def remove(self, list_name: str, *ops: str) -> AmpLists:
        """Remove ``ops`` from ``list_name``; removing an op that is not there is an error."""
        names = _check_known(ops, f"AmpLists.remove({list_name!r}, ...)")
        trial = self._copy_sets()
        for name in names:
            if name not in trial[_check_list_name(list_name)]:
                where = self.list_of(name)
                raise ValueError(
                    f"op {name!r} is not on the {list_name} list (it is on "
                    f"{'no list' if where is None else f'the {where} list'}), so it cannot "
                    "be removed from it"
                )
            trial[list_name].discard(name)
        self._sets = trial
        return self

    def with_env(self, environ: Mapping[str, str] | None = None) -> AmpLists:
        """A copy with the ``MIXPREC_*LIST_{ADD,REMOVE}`` overrides of ``environ`` applied.

        ``environ`` defaults to ``os.environ``. All removals come before all additions.

        >>> env = {"MIXPREC_DENYLIST_REMOVE": "softmax", "MIXPREC_INFERLIST_ADD": "softmax"}
        >>> AmpLists().with_env(env).list_of("softmax")
        'infer'
        """
        environ = os.environ if environ is None else environ
        trial = self._copy_sets()
        for action in ("REMOVE", "ADD"):
            for list_name in LIST_NAMES:
                var = f"MIXPREC_{list_name.upper()}LIST_{action}"
                raw = environ.get(var, "")
                names = _check_known(
                    [part for part in raw.split(",") if part.strip()],
                    f"the environment variable {var}={raw!r}",
                )
                for name in names:
                    if action == "ADD":
                        trial[list_name].add(name)
                    elif name in trial[list_name]:
                        trial[list_name].discard(name)
                    else:
                        raise ValueError(
                            f"{var}={raw!r} removes {name!r}, which is not on the "
                            f"{list_name} list; check the variable's list name"
                        )
        try:
            _check_disjoint(trial)
        except ValueError as err:
            raise ValueError(f"{err} (after applying MIXPREC_*LIST_* variables)") from None
        result = AmpLists.__new__(AmpLists)
        result._sets = trial
        return result

    def copy(self) -> AmpLists:
        """An independent copy."""
        result = AmpLists.__new__(AmpLists)
        result._sets = self._copy_sets()
        return result

    def _copy_sets(self) -> dict[str, set[str]]:
        return {name: set(ops) for name, ops in self._sets.items()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AmpLists):
            return NotImplemented
        return self._sets == other._sets

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={len(self._sets[name])} ops" for name in LIST_NAMES)
        return f"AmpLists({sizes})"


def _check_disjoint(sets: Mapping[str, set[str]]) -> None:
    for i, first in enumerate(LIST_NAMES):
        for second in LIST_NAMES[i + 1 :]:
            both = sorted(sets[first] & sets[second])
            if both:
                raise ValueError(
                    f"op {both[0]!r} would be in both the {first} list and the {second} "
                    f"list; an op belongs to one list: remove it from one of them first"
                )
