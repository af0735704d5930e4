"""Precision policies: which dtype a layer stores, computes in, and hands on.

A :class:`Policy` is a frozen value of three dtypes:

* ``param_dtype``: how the layer's parameters are stored (and stepped);
* ``compute_dtype``: the dtype its inputs and parameters are cast to for the math;
* ``output_dtype``: the dtype of the tensors it returns.

Policies are spelled by name or by a short grammar, and ``str(policy)`` always
parses back to an equal policy::

    "float32" | "float16" | "bfloat16" | "float64"    all three dtypes the same (any dtype
                                                      spelling below works too: "bf16")
    "mixed_float16"                                   p=f32, c=f16,  o=f16
    "mixed_bfloat16"                                  p=f32, c=bf16, o=bf16
    "p=f32,c=bf16,o=f32"                              any combination; keys p|param|params,
    "params=float32,compute=float16,output=float32"   c|compute, o|output; dtypes f32|fp32|
                                                      float32|float|full, f16|fp16|float16|
                                                      half, bf16|bfloat16, f64|fp64|float64|
                                                      double
    "full" | "half"                                   all float32 | all float16

The grammar is jmp's (``"c=bf16,o=full"``, ``"half"``): a key left out follows the one
before it (params default to float32, compute to params, output to compute).

Output dtype of the ``mixed_*`` policies: the compute dtype (variables
float32, computations and layer outputs float16). A layer's output is usually the
next layer's input, so keeping it in the compute dtype avoids a cast back and forth
between every pair of layers; a model's *final* output is cast to float32 by
``mixprec.amp`` (or by giving the last layer ``"float32"`` / ``"p=f32,c=f16,o=f32"``),
so a loss computed from it is computed in float32 (one computed inside the model's
forward is computed in the forward's dtype: see the levels guide).

The global policy (``set_global_policy`` / ``global_policy``, and ``policy_scope``
for a block) is the policy ``mixprec.amp.set_policy`` applies when it is given none.

>>> p = Policy("mixed_bfloat16")
>>> p.param_dtype, p.compute_dtype, p.output_dtype
(torch.float32, torch.bfloat16, torch.bfloat16)
>>> Policy("p=f32,c=bf16,o=bf16") == p, str(p)
(True, 'mixed_bfloat16')
>>> str(Policy("params=float32,compute=float16,output=float32"))
'p=f32,c=f16,o=f32'
>>> str(Policy("c=bf16,o=full")), str(p.with_output_dtype(torch.float32))
('p=f32,c=bf16,o=f32', 'p=f32,c=bf16,o=f32')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mixprec._checks import DTYPE_NAMES, FLOATING, as_dtype, short_name

__all__ = [
    "Policy",
    "PolicyLike",
    "POLICY_NAMES",
    "cast_floating",
    "set_global_policy",
    "global_policy",
    "policy_scope",
]

_KEYS = {
    "p": "param_dtype",
    "param": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}

_NAMED: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "float32": (torch.float32,) * 3,
    "float16": (torch.float16,) * 3,
    "bfloat16": (torch.bfloat16,) * 3,
    "float64": (torch.float64,) * 3,
    "mixed_float16": (torch.float32, torch.float16, torch.float16),
    "mixed_bfloat16": (torch.float32, torch.bfloat16, torch.bfloat16),
}
_BY_DTYPES = {dtypes: name for name, dtypes in _NAMED.items()}

#: The policy names :class:`Policy` accepts besides the ``p=..,c=..,o=..`` grammar.
POLICY_NAMES: tuple[str, ...] = tuple(_NAMED)

_FIXES = (
    f"use one of {', '.join(repr(n) for n in POLICY_NAMES)}, or 'p=<dtype>,c=<dtype>,o=<dtype>' "
    f"with dtypes {', '.join(sorted(short_name(d) for d in FLOATING))}"
)

#: Spellings a policy accepts on top of the dtype table: jmp's "full" (and "half",
#: which is float16 in the table already; jmp picks bfloat16 for it on TPUs).
_POLICY_SPELLINGS = {"full": torch.float32}


def _policy_dtype(value: Any, what: str) -> torch.dtype:
    """A dtype as a policy spells it: a ``torch.dtype``, any name in the dtype table, or ``full``."""
    if isinstance(value, str) and value.strip().lower() in _POLICY_SPELLINGS:
        return _POLICY_SPELLINGS[value.strip().lower()]
    try:
        return as_dtype(value, what)
    except ValueError as err:
        if isinstance(value, str):  # the table's list of spellings, plus this one
            raise ValueError(f"{err}, {', '.join(_POLICY_SPELLINGS)}") from None
        raise


def _parse(name: str) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The ``(param, compute, output)`` dtypes that a policy string names."""
    text = name.strip().lower()
    if text in _NAMED:
        return _NAMED[text]
    if text in DTYPE_NAMES or text in _POLICY_SPELLINGS:
        return (_policy_dtype(text, "policy"),) * 3
    if "=" not in text:
        raise ValueError(f"unknown policy name {name!r}; {_FIXES}")
    found: dict[str, torch.dtype] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"policy {name!r}: cannot read {item.strip()!r}; each item is <key>=<dtype> "
                f"with key one of {', '.join(_KEYS)}"
            )
        field = _KEYS[key]
        if field in found:
            raise ValueError(f"policy {name!r} gives the {field.split('_')[0]} dtype twice")
        found[field] = _policy_dtype(value, f"policy {name!r}")
    return _fill(found.get("param_dtype"), found.get("compute_dtype"), found.get("output_dtype"))


def _fill(
    param: torch.dtype | None, compute: torch.dtype | None, output: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    # A missing dtype follows the one before it: params default to float32, compute
    # to the param dtype, output to the compute dtype ("c=bf16" is mixed_bfloat16).
    param = torch.float32 if param is None else param
    compute = param if compute is None else compute
    return param, compute, compute if output is None else output


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy:
    """A frozen (param dtype, compute dtype, output dtype) triple, parsed from a name.

    ``Policy(name)`` takes a policy name or the ``p=..,c=..,o=..`` grammar (see the
    module docstring), a ``torch.dtype`` (all three the same) or another ``Policy``;
    ``Policy(param_dtype=..., compute_dtype=..., output_dtype=...)`` takes the
    dtypes directly, each a ``torch.dtype`` or a name. A dtype left out follows the
    one before it: params default to float32, compute to params, output to compute.

    Two policies are equal when their three dtypes are, however they were spelled;
    ``str()`` gives the policy's name when it has one, otherwise the short grammar.

    >>> Policy("mixed_float16")
    Policy('mixed_float16')
    >>> Policy(compute_dtype=torch.bfloat16, output_dtype="f32")
    Policy('p=f32,c=bf16,o=f32')
    >>> Policy(torch.float16) == Policy("half") == Policy(param_dtype="f16")
    True
    >>> Policy("mixed_int8")
    Traceback (most recent call last):
    ...
    ValueError: unknown policy name 'mixed_int8'; use one of 'float32', ...
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype

    def __init__(
        self,
        name: PolicyLike | None = None,
        *,
        param_dtype: torch.dtype | str | None = None,
        compute_dtype: torch.dtype | str | None = None,
        output_dtype: torch.dtype | str | None = None,
    ) -> None:
        given = {
            k: v
            for k, v in (
                ("param_dtype", param_dtype),
                ("compute_dtype", compute_dtype),
                ("output_dtype", output_dtype),
            )
            if v is not None
        }
        if name is not None and given:
            raise TypeError(
                f"Policy takes a name or dtype keywords, not both: got name={name!r} and "
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())}"
            )
        if isinstance(name, Policy):
            dtypes = (name.param_dtype, name.compute_dtype, name.output_dtype)
        elif isinstance(name, torch.dtype):
            dtypes = (as_dtype(name, "Policy"),) * 3
        elif isinstance(name, str):
            dtypes = _parse(name)
        elif name is None:
            if not given:
                raise TypeError(
                    "Policy needs a name (e.g. Policy('mixed_bfloat16')) or dtype keywords "
                    "(e.g. Policy(compute_dtype=torch.bfloat16))"
                )
            dtypes = _fill(*(_policy_dtype(given[k], k) if k in given else None for k in _FIELDS))
        else:
            raise TypeError(
                f"Policy name must be a str, torch.dtype or Policy, got "
                f"{type(name).__name__} {name!r}; {_FIXES}"
            )
        for field, dtype in zip(_FIELDS, dtypes):
            object.__setattr__(self, field, dtype)

    @property
    def name(self) -> str:
        """The policy's name (``'mixed_float16'``) or short form (``'p=f32,c=bf16,o=f32'``)."""
        dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
        if dtypes in _BY_DTYPES:
            return _BY_DTYPES[dtypes]
        return ",".join(f"{k}={short_name(d)}" for k, d in zip("pco", dtypes))

    @property
    def is_mixed(self) -> bool:
        """Whether parameters are stored in a different dtype than they are used in."""
        return self.param_dtype != self.compute_dtype

    def with_output_dtype(self, output_dtype: torch.dtype | str) -> Policy:
        """This policy with another output dtype (jmp's ``Policy.with_output_dtype``).

        >>> Policy("mixed_float16").with_output_dtype("full")
        Policy('p=f32,c=f16,o=f32')
        """
        return Policy(
            param_dtype=self.param_dtype,
            compute_dtype=self.compute_dtype,
            output_dtype=_policy_dtype(output_dtype, "output_dtype"),
        )

    def cast_to_param(self, tree: Any) -> Any:
        """``tree`` with its floating tensors cast to the param dtype (see :func:`cast_floating`)."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """``tree`` with its floating tensors cast to the compute dtype."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """``tree`` with its floating tensors cast to the output dtype."""
        return cast_floating(tree, self.output_dtype)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")

#: Anything :class:`Policy` accepts as its first argument.
PolicyLike = Policy | str | torch.dtype


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested structure to ``dtype``.

    Lists, tuples (named ones too) and mappings are rebuilt only where something
    changed; integer, bool and complex tensors and non-tensors pass through, so
    token ids and masks of indices are never touched. The casts are differentiable.
    A tensor that appears several times is cast once and stays one object, so code
    that checks identity (self-attention's ``query is key``) sees what it would have.

    >>> x, ids = torch.ones(2), torch.arange(2)
    >>> out = cast_floating({"x": x, "ids": ids, "n": 3}, torch.bfloat16)
    >>> out["x"].dtype, out["ids"].dtype, out["n"]
    (torch.bfloat16, torch.int64, 3)
    >>> cast_floating((x, ids), torch.float32)[0] is x      # nothing to do: same objects
    True
    >>> q, k = cast_floating((x, x), torch.bfloat16); q is k
    True
    """
    if _nothing_to_cast(tree, dtype):
        return tree
    return _cast_tree(tree, dtype, {})


#: Leaves that are never cast, checked by exact type first: every module call passes
#: through here, and the Mapping check below is slow for them.
_PLAIN_LEAVES = frozenset({type(None), bool, int, float, str})


def _nothing_to_cast(tree: Any, dtype: torch.dtype) -> bool:
    """True when ``tree`` certainly holds no floating tensor of another dtype: the usual
    case of every hook call (a module's arguments already in its dtype), answered in one
    loop, with no calls per item. Plain tuples, lists and dicts are looked into; any
    other container answers False, and :func:`_cast_tree` looks (and copies nothing
    when nothing needs a cast)."""
    pending = [tree]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _PLAIN_LEAVES:
            continue
        if isinstance(item, torch.Tensor):
            if item.dtype != dtype and item.is_floating_point():
                return False
        elif kind is tuple or kind is list:
            pending.extend(item)
        elif kind is dict:
            pending.extend(item.values())
        else:
            return False
    return True


def _cast_tree(tree: Any, dtype: torch.dtype, done: dict[int, torch.Tensor]) -> Any:
    kind = type(tree)
    if kind in _PLAIN_LEAVES:
        return tree
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.dtype != dtype:
            cast = done.get(id(tree))
            if cast is None:
                cast = done[id(tree)] = tree.to(dtype)
            return cast
        return tree
    if isinstance(tree, (list, tuple)):
        items = [_cast_tree(item, dtype, done) for item in tree]
        if all(map(operator.is_, items, tree)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return kind(*items)
        return kind(items)
    if isinstance(tree, Mapping):
        if not tree:
            return tree
        values = {key: _cast_tree(value, dtype, done) for key, value in tree.items()}
        if all(values[key] is value for key, value in tree.items()):
            return tree
        make: Any = kind  # the tree's own mapping type; Mapping's says nothing of it
        try:
            return make(values)
        except TypeError:
            # A mapping type whose constructor takes something else: a plain dict
            # keeps the data, which is what the layer reads.
            return values
    return tree


_DEFAULT = Policy("float32")
_global: Policy = _DEFAULT
_scoped: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "mixprec_policy_scope", default=None
)


def set_global_policy(policy: PolicyLike | None) -> None:
    """Set the process-wide default policy (``None`` restores ``"float32"``).

    It is the policy ``mixprec.amp.set_policy(module)`` applies when given none.
    A :func:`policy_scope` in effect still takes precedence inside its block.

    >>> set_global_policy("mixed_bfloat16"); str(global_policy())
    'mixed_bfloat16'
    >>> set_global_policy(None); str(global_policy())
    'float32'
    """
    global _global
    _global = _DEFAULT if policy is None else Policy(policy)


def global_policy() -> Policy:
    """The policy in effect: the innermost :func:`policy_scope`, else the global one.

    >>> str(global_policy())
    'float32'
    """
    scoped = _scoped.get()
    return _global if scoped is None else scoped


@contextlib.contextmanager
def policy_scope(policy: PolicyLike) -> Iterator[Policy]:
    """Make ``policy`` the one :func:`global_policy` returns inside a ``with`` block.

    Scopes nest and are local to the thread (and asyncio task) that opens them; the
    previous policy comes back when the block exits, also on an exception.

    >>> with policy_scope("mixed_float16") as p:
    ...     str(global_policy()), p == global_policy()
    ('mixed_float16', True)
    >>> str(global_policy())
    'float32'
    """
    scoped = Policy(policy)
    token = _scoped.set(scoped)
    try:
        yield scoped
    finally:
        _scoped.reset(token)
