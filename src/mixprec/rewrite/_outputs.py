"""Model outputs a graph cannot return as they are: taken apart for capture, rebuilt per call.

``torch.export`` returns tensors in containers it knows (tuples, lists, dicts and
registered types such as Hugging Face's ``ModelOutput``); a default Hugging Face
model also returns a key/value cache object, which it does not know. The capture
takes such an output apart into its tensors (the graph's outputs) and a
:class:`Structure` (everything else), and the rewritten graph ends in an
:class:`OutputStructure` call that puts the output together again, fresh on every
call, the way ``copy.copy`` rebuilds an object::

    flatten(value):
        tensor, SymInt                  -> a graph output
        None, bool, number, str, dtype, device, module, class, function -> kept as is
        tuple, list, dict, registered pytree type (ModelOutput) -> its children
        dataclass or other object       -> its pickle reduction (class, state dict):
                                           the state's values are flattened in turn
        anything else (no reduction)    -> OutputTypeError naming where it is

An object met twice is rebuilt once and shared, as in the original output.

>>> import torch
>>> from types import SimpleNamespace
>>> out = {"logits": torch.ones(2), "cache": SimpleNamespace(keys=[torch.zeros(1)], step=3)}
>>> leaves, structure = flatten_output(out)
>>> [tuple(t.shape) for t in leaves]
[(2,), (1,)]
>>> again = structure.rebuild([torch.full((2,), 5.0), torch.ones(1)])
>>> again["logits"], again["cache"].keys, again["cache"].step
(tensor([5., 5.]), [tensor([1.])], 3)
>>> needs_flattening(out), needs_flattening((torch.ones(1), None))
(True, False)
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

#: The submodule of a rewritten graph that rebuilds its output.
OUTPUT_STRUCTURE_NAME = "output_structure"

# Values kept as they are: immutable, or shared by reference on purpose (modules,
# classes and functions are part of the program, not of one call's result).
_CONSTANTS = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
    torch.layout, torch.memory_format, enum.Enum, type, nn.Module, types.FunctionType,
    types.BuiltinFunctionType, types.MethodType, types.ModuleType, type(Ellipsis), range,
)  # fmt: skip
# How pickle protocols 2+ rebuild an instance: ``cls.__new__(cls, *args)``.
_NEWOBJ = vars(copyreg)["__newobj__"]
# What a graph returns directly: tensors and symbolic sizes.
_GRAPH_VALUES = (torch.Tensor, fx.Proxy, torch.SymInt, torch.SymFloat, torch.SymBool)


class OutputTypeError(TypeError):
    """A model output holds a value that can be neither returned by a graph nor rebuilt."""


def needs_flattening(value: Any) -> bool:
    """Whether ``value`` holds something ``torch.export`` cannot return as it is."""
    return any(
        not isinstance(leaf, _GRAPH_VALUES + (type(None), bool, int, float, str))
        for leaf in pytree.tree_leaves(value)
    )


@dataclasses.dataclass(frozen=True)
class _Leaf:
    index: int


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: Any


@dataclasses.dataclass(frozen=True)
class _Node:
    spec: pytree.TreeSpec
    children: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Object:
    key: int
    make: Any
    args: Any
    state: Any
    items: Any
    entries: Any


@dataclasses.dataclass(frozen=True)
class _Ref:
    key: int


class Structure:
    """How to put a flattened output together again (see the module docstring)."""

    def __init__(self, root: Any, leaves: int) -> None:
        self._root = root
        self.leaves = leaves

    def rebuild(self, leaves: Sequence[Any]) -> Any:
        """The output, with ``leaves`` (the graph's results) in the places of its tensors."""
        if len(leaves) != self.leaves:
            raise ValueError(f"expected {self.leaves} graph outputs, got {len(leaves)}")
        return self._build(self._root, leaves, {})

    def _build(self, part: Any, leaves: Sequence[Any], made: dict[int, Any]) -> Any:
        if isinstance(part, _Leaf):
            return leaves[part.index]
        if isinstance(part, _Constant):
            return part.value
        if isinstance(part, _Node):
            children = [self._build(child, leaves, made) for child in part.children]
            return pytree.tree_unflatten(children, part.spec)
        if isinstance(part, _Ref):
            return made[part.key]
        args = self._build(part.args, leaves, made)
        obj = part.make(*args)
        made[part.key] = obj  # before the state: the state may refer back to the object
        state = self._build(part.state, leaves, made)
        if state is not None:
            _set_state(obj, state)
        for item in self._build(part.items, leaves, made) or ():
            obj.append(item)
        for key, item in self._build(part.entries, leaves, made) or ():
            obj[key] = item
        return obj


def _set_state(obj: Any, state: Any) -> None:
    """Give a rebuilt object its state, as unpickling does."""
    setter = getattr(obj, "__setstate__", None)
    if setter is not None:
        setter(state)
        return
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        obj.__dict__.update(state)
    for name, value in (slots or {}).items():
        setattr(obj, name, value)


def flatten_output(value: Any) -> tuple[list[Any], Structure]:
    """Split ``value`` into its tensors and a :class:`Structure` that rebuilds it.

    Raises :class:`OutputTypeError` for a value that has no pickle reduction.
    """
    leaves: list[Any] = []
    seen: dict[int, int] = {}
    keep: list[Any] = []  # holds every visited object, so no id() is reused meanwhile

    def visit(part: Any, where: str) -> Any:
        if isinstance(part, _GRAPH_VALUES):
            leaves.append(part)
            return _Leaf(len(leaves) - 1)
        if isinstance(part, _CONSTANTS):
            return _Constant(part)
        if id(part) in seen:
            return _Ref(seen[id(part)])
        keep.append(part)
        children, spec = pytree.tree_flatten(part, is_leaf=lambda child: child is not part)
        if not spec.is_leaf():
            keys = _child_names(part, len(children))
            return _Node(spec, tuple(visit(c, where + k) for c, k in zip(children, keys)))
        seen[id(part)] = len(seen)
        try:
            reduced = part.__reduce_ex__(4)
        except Exception as err:  # the object cannot be copied or pickled
            raise OutputTypeError(_unsupported(part, where, str(err))) from err
        if isinstance(reduced, str):  # a global singleton, pickled by name
            return _Constant(part)
        make, args, state, items, entries = (tuple(reduced) + (None,) * 5)[:5]
        if make is _NEWOBJ:
            make, args = args[0].__new__, args
        return _Object(
            seen[id(part)],
            make,
            visit(tuple(args or ()), f"{where}.<args>"),
            visit(state, where if isinstance(state, dict) else f"{where}.<state>"),
            visit(None if items is None else list(items), f"{where}.<items>"),
            visit(None if entries is None else list(entries), f"{where}.<entries>"),
        )

    root = visit(value, "output")
    return leaves, Structure(root, len(leaves))


def _child_names(part: Any, count: int) -> list[str]:
    """How each child of a container is reached (``[0]``, ``['key']``, ``.field``)."""
    try:
        paths = pytree.tree_flatten_with_path(part, is_leaf=lambda child: child is not part)[0]
        return [pytree.keystr(path) for path, _ in paths]
    except Exception:  # a registered type without key paths: number the children
        return [f"[{i}]" for i in range(count)]


def _unsupported(part: Any, where: str, why: str) -> str:
    name = f"{type(part).__module__}.{type(part).__qualname__}"
    return (
        f"the model's output holds a {name} at {where}, which a graph cannot return and the "
        f"rewrite cannot rebuild ({why}). Return tensors, or tuples, lists, dicts, "
        "dataclasses or plain objects of them: wrap the model in an nn.Module whose forward "
        "returns what training needs (e.g. model(x).logits)"
    )


class OutputStructure(nn.Module):
    """The last call of a rewritten graph: rebuilds the model's output from the graph's.

    >>> leaves, structure = flatten_output({"y": torch.ones(1), "n": 2})
    >>> OutputStructure(structure)(torch.zeros(1))
    {'y': tensor([0.]), 'n': 2}
    """

    def __init__(self, structure: Structure) -> None:
        super().__init__()
        self.structure = structure

    def forward(self, *leaves: Any) -> Any:
        return self.structure.rebuild(leaves)


def attach_output_structure(gm: fx.GraphModule, structure: Structure) -> None:
    """End ``gm``'s graph, which returns the flattened output, with an :class:`OutputStructure`."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = pytree.tree_leaves(output.args[0], is_leaf=lambda v: isinstance(v, fx.Node))
    if len(results) != structure.leaves:
        raise RuntimeError(
            f"the captured graph returns {len(results)} values where the output has "
            f"{structure.leaves} tensors"
        )
    gm.add_submodule(OUTPUT_STRUCTURE_NAME, OutputStructure(structure))
    with graph.inserting_before(output):
        rebuilt = graph.call_module(OUTPUT_STRUCTURE_NAME, tuple(results))
    codegen: Any = graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        # An exported graph unflattens its outputs by a spec; it now returns one object.
        codegen.pytree_info = info._replace(out_spec=pytree.tree_structure(0))
        output.args = ((rebuilt,),)
    else:
        output.args = (rebuilt,)
    graph.lint()
    gm.recompile()
