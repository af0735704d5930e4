"""Carry out a cast plan on the graph, then remove casts that cancel or do nothing.

Algorithm::

    record colour, list and reason of every op in node.meta["mixprec"]
    point uses at their planned sources (redundant user casts, low -> f32 -> low chains)
    split the bias off the planned linear/conv ops:  y = op(x, w); y = y + bias
    insert one aten.to.dtype node per planned (value, dtype), after the value,
        and point every planned use at it
    painted ops with dtype=float32 arguments (softmax, sum, factories) get the low dtype
    update node.meta["val"] dtypes
    repeat: drop casts to the dtype their input has; drop the second cast of
            low -> float32 -> low chains (exact); drop casts nobody uses

>>> import torch
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x"); x.meta["val"] = torch.empty(2, dtype=torch.float16)
>>> up = g.call_function(torch.ops.aten.to.dtype, (x, torch.float32))
>>> up.meta["val"] = torch.empty(2)
>>> down = g.call_function(torch.ops.aten.to.dtype, (up, torch.float16))
>>> down.meta["val"] = torch.empty(2, dtype=torch.float16)
>>> _ = g.output(down)
>>> simplify_casts(g), [n.op for n in g.nodes]
(2, ['placeholder', 'output'])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.shape_prop import TensorMetadata

from mixprec.rewrite._nodes import (
    arg_items,
    cast_target,
    is_tuple_getitem,
    module_path,
    mutated_arg_names,
    op_name,
    tensor_dtype,
    tensor_ndim,
)
from mixprec.rewrite._paint import Painting
from mixprec.rewrite._plan import CastPlan

CAST_OP = torch.ops.aten.to.dtype
_F32 = torch.float32
_LOW = (torch.float16, torch.bfloat16)


def _retype(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (a node's recorded output) with its float32 tensors as ``dtype``."""
    if isinstance(value, TensorMetadata):
        return value._replace(dtype=dtype) if value.dtype == _F32 else value
    if isinstance(value, torch.Tensor):
        if value.dtype != _F32:
            return value
        mode = detect_fake_mode([value])
        if mode is not None:
            with mode:
                return value.to(dtype)
        return torch.empty_like(value, dtype=dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_retype(v, dtype) for v in value)
    return value


def _infer_val(node: fx.Node) -> None:
    """Fill ``node.meta["val"]`` by running its op on its inputs' recorded values."""
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    leaves = [v for v in torch.utils._pytree.tree_leaves(args) if isinstance(v, torch.Tensor)]
    if not leaves or any(isinstance(v, fx.Node) for v in torch.utils._pytree.tree_leaves(args)):
        return
    mode = detect_fake_mode(leaves)
    if mode is None and any(t.device.type != "meta" for t in leaves):
        return
    try:
        if mode is not None:
            with mode:
                node.meta["val"] = node.target(*args[0], **args[1])
        else:
            node.meta["val"] = node.target(*args[0], **args[1])
    except Exception:  # metadata only: a failure leaves the node without a value
        node.meta.pop("val", None)


def _replace_input(node: fx.Node, old: fx.Node, new: fx.Node, exempt: frozenset[str]) -> None:
    names = [name for name, _ in arg_items(node)][: len(node.args)]
    args = [
        value if name in exempt else fx.node.map_arg(value, lambda n: new if n is old else n)
        for name, value in zip(names, node.args, strict=True)
    ]
    kwargs = {
        name: value if name in exempt else fx.node.map_arg(value, lambda n: new if n is old else n)
        for name, value in node.kwargs.items()
    }
    node.args, node.kwargs = tuple(args), kwargs


def _set_named_arg(node: fx.Node, name: str, value: Any) -> None:
    names = [n for n, _ in arg_items(node)][: len(node.args)]
    if name in names:
        args = list(node.args)
        args[names.index(name)] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _split_bias(graph: fx.Graph, op_node: fx.Node) -> fx.Node:
    bias = dict(arg_items(op_node))["bias"]
    _set_named_arg(op_node, "bias", None)
    # A conv's bias broadcasts over the spatial dimensions: view it as (C, 1, ..., 1).
    spatial = (tensor_ndim(op_node) or 2) - 2
    rank_fix = op_name(op_node) != "linear" and spatial > 0
    anchor = op_node
    if rank_fix:
        with graph.inserting_after(anchor):
            anchor = graph.call_function(torch.ops.aten.view.default, (bias, [-1] + [1] * spatial))
        _infer_val(anchor)
        anchor.meta["mixprec"] = {"role": "bias-view", "path": module_path(op_node)}
    with graph.inserting_after(anchor):
        added = graph.call_function(
            torch.ops.aten.add.Tensor, (op_node, anchor if rank_fix else bias)
        )
    for key in ("val", "tensor_meta"):
        if key in op_node.meta:
            added.meta[key] = op_node.meta[key]
    added.meta["mixprec"] = {
        "role": "bias-add",
        "op": "add",
        "list": None,
        "colour": "float32",
        "path": module_path(op_node),
        "reason": f"float32: bias of {op_node.name} added after it, as its consumers want "
        "float32 (no cast of the bias or the output)",
    }
    op_node.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
    return added


def _modified_in_place(value: fx.Node) -> bool:
    """Whether an in-place op of the graph writes to ``value``."""
    for user in value.users:
        written = mutated_arg_names(user)
        if any(value in _arg_nodes(v) for k, v in arg_items(user) if k in written):
            return True
    return False


def _arg_nodes(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _fix_dtype_arguments(node: fx.Node, dtype: torch.dtype) -> None:
    names = dict(arg_items(node))
    if "dtype" not in names and not isinstance(node.target, torch._ops.OpOverload):
        return
    if isinstance(node.target, torch._ops.OpOverload):
        if "dtype" not in [a.name for a in node.target._schema.arguments]:
            return
    value = names.get("dtype")
    has_float_input = any(tensor_dtype(a) is not None for a in node.all_input_nodes)
    if value == _F32 or (value is None and not has_float_input):
        _set_named_arg(node, "dtype", dtype)


def apply_plan(
    gm: fx.GraphModule, painting: Painting, plan: CastPlan, saved: dict[fx.Node, int]
) -> int:
    """Rewrite ``gm``'s graph after ``plan`` (see the module docstring); return the casts left."""
    graph = gm.graph
    dtype = painting.dtype
    for v in painting.vertices:
        low = v in plan.low
        reason = painting.reason[v]
        if v in saved:
            reason = f"float32: {reason.partition(': ')[2]}, but float32 saves {saved[v]} cast(s)"
        elif low and v not in painting.low:
            reason = "allow: in-place op on a low-precision tensor"
        v.meta["mixprec"] = {
            "role": "op",
            "op": painting.op[v],
            "list": painting.list_name[v],
            "colour": str(dtype if low else _F32).replace("torch.", ""),
            "path": painting.paths[v],
            "rule": "cast-saving" if v in saved else painting.rule[v],
            "reason": reason,
        }
    for (consumer, value), source in plan.rewire.items():
        _replace_input(consumer, value, source, plan.exempt.get(consumer, frozenset()))
    for user_cast in reversed([n for n in graph.nodes if n in plan.redundant]):
        source = user_cast.args[0]
        user_cast.replace_all_uses_with(source)
        graph.erase_node(user_cast)
    for op_node in plan.bias_splits:
        _split_bias(graph, op_node)

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last_input = placeholders[-1] if placeholders else None
    order = {n: i for i, n in enumerate(graph.nodes)}
    for (source, want), consumers in plan.casts.items():
        meta = {
            "role": "cast",
            "path": module_path(source),
            "reason": f"cast {source.name} to {str(want).replace('torch.', '')}",
        }
        if _modified_in_place(source):
            # A shared cast placed after the value would miss later in-place
            # changes to it: cast right before each consumer instead.
            for consumer in consumers:
                with graph.inserting_before(consumer):
                    cast = graph.call_function(CAST_OP, (source, want))
                cast.meta["mixprec"] = dict(meta)
                _replace_input(consumer, source, cast, plan.exempt.get(consumer, frozenset()))
            continue
        anchor = source
        if source.op in ("placeholder", "get_attr") and last_input is not None:
            anchor = last_input if order[last_input] > order[source] else source
        with graph.inserting_after(anchor):
            cast = graph.call_function(CAST_OP, (source, want))
        cast.meta["mixprec"] = meta
        for consumer in consumers:
            _replace_input(consumer, source, cast, plan.exempt.get(consumer, frozenset()))

    for v in plan.low:
        _fix_dtype_arguments(v, dtype)
        if "val" in v.meta:
            v.meta["val"] = _retype(v.meta["val"], dtype)
        if "tensor_meta" in v.meta:
            v.meta["tensor_meta"] = _retype(v.meta["tensor_meta"], dtype)
        for user in v.users:
            if is_tuple_getitem(user):
                for key in ("val", "tensor_meta"):
                    if key in user.meta:
                        user.meta[key] = _retype(user.meta[key], dtype)
    for node in graph.nodes:
        if node.meta.get("mixprec", {}).get("role") in ("cast", "bias-view"):
            _infer_val(node)
    simplify_casts(graph)
    graph.lint()
    gm.recompile()
    return sum(1 for n in graph.nodes if n.meta.get("mixprec", {}).get("role") == "cast")


def _exact_round_trip(inner: torch.dtype | None, wide: torch.dtype | None) -> bool:
    return (inner in _LOW and wide in (_F32, torch.float64)) or (
        inner == _F32 and wide == torch.float64
    )


def simplify_casts(graph: fx.Graph) -> int:
    """Remove casts that do nothing or undo an exact widening; return how many went."""
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            target = cast_target(node)
            if target is None or not isinstance(node.args[0], fx.Node):
                continue
            source = node.args[0]
            replacement = None
            if not node.users:
                graph.erase_node(node)
                removed += 1
                changed = True
                continue
            if tensor_dtype(source) == target:
                replacement = source
            elif cast_target(source) is not None and isinstance(source.args[0], fx.Node):
                origin = source.args[0]
                if tensor_dtype(origin) == target and _exact_round_trip(
                    target, cast_target(source)
                ):
                    replacement = origin
            if replacement is not None:
                node.replace_all_uses_with(replacement)
                graph.erase_node(node)
                removed += 1
                changed = True
    return removed
