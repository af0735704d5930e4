"""Paint a float32 graph: decide which ops run in low precision, the classic way.

The vertices are the ops that produce float32 tensors; edges carry float32 tensors
(an element picked from a tuple of outputs counts as an edge from the tuple's op).
Inputs, parameters, integer/bool/float64 values and shape queries are never painted.
Each vertex is classified by the list holding its op name (see ``lists.py``)::

    allow_set = {v : list(v) == allow}                                 # 1. allow
    fed = {v : v is deny/infer} + clear ops reaching one through clear ops, walking
          inputs backwards                                            # 2. deny spreads
    deny_set = deny ops + everything reachable forward from one inside `fed`
    down = infer/clear ops reachable forward from an allow op through infer/clear ops
           not in deny_set                                            # 3. between allows
    allow_set += ops of `down` from which an allow op is reachable inside `down`
    repeat until nothing changes:
        allow_set += clear ops connected to allow_set through clear ops
                     not in deny_set (inputs and outputs)             # 4. clear regions
        allow_set += infer ops not in deny_set with an input in allow_set and no input
                     in deny_set, in graph order                      # 5. follow allow
    every other vertex stays float32

Levels: ``treat_infer_as_deny`` classifies Infer ops as Deny; ``allow_only`` stops
after step 1; ``unsafe_force_all`` paints every paintable vertex.

A vertex that cannot run in low precision is never painted and blocks the
propagation: a ``call_module`` node whose module holds float parameters (they
cannot be cast in the graph), or an in-place op that had to stay in place (it
keeps the dtype of the tensor it modifies).

>>> import torch
>>> from mixprec.rewrite._lists import AmpLists
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x"); x.meta["val"] = torch.empty(2, 2)
>>> mm = g.call_function(torch.ops.aten.mm.default, (x, x))
>>> sm = g.call_function(torch.ops.aten.softmax.int, (mm, -1))
>>> for n in (mm, sm): n.meta["val"] = torch.empty(2, 2)
>>> _ = g.output(sm)
>>> painting = paint(g, AmpLists(), torch.float16)
>>> painting.is_low(mm), painting.is_low(sm), painting.reason[sm]
(True, False, 'deny: on the deny list')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import fx, nn

from mixprec.rewrite._lists import AmpLists, check_level
from mixprec.rewrite._nodes import (
    SHAPE_ONLY,
    cast_target,
    float_outputs,
    is_float32_tensor,
    is_tuple_getitem,
    module_path,
    mutated_arg_names,
    op_name,
)

# Rules that paint a vertex only to save casts or keep neighbours together; the
# cast planner may return such a vertex to float32 when that saves casts.
FLEXIBLE_RULES = frozenset({"clear-region", "follows-allow"})


@dataclasses.dataclass
class Painting:
    """Which vertices run in low precision, and why each vertex got its colour."""

    graph: fx.Graph
    root: nn.Module | None
    lists: AmpLists
    dtype: torch.dtype
    level: str
    vertices: list[fx.Node]
    low: set[fx.Node]
    op: dict[fx.Node, str]
    list_name: dict[fx.Node, str | None]
    rule: dict[fx.Node, str]
    reason: dict[fx.Node, str]
    producers: dict[fx.Node, list[fx.Node]]
    consumers: dict[fx.Node, list[fx.Node]]
    paths: dict[fx.Node, str]

    def is_low(self, node: fx.Node) -> bool:
        """Whether ``node`` (or the tuple op it picks from) was painted."""
        if is_tuple_getitem(node):
            node = node.args[0]
        return node in self.low

    def flexible(self) -> set[fx.Node]:
        """Painted vertices that were painted by a propagation rule only."""
        return {v for v in self.low if self.rule[v] in FLEXIBLE_RULES}


def _has_float_state(module: nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return any(t.is_floating_point() for t in tensors)


def _is_vertex(node: fx.Node, root: nn.Module | None) -> bool:
    if node.op not in ("call_function", "call_method", "call_module") or is_tuple_getitem(node):
        return False
    if cast_target(node) is not None or op_name(node, root) in SHAPE_ONLY:
        return False
    return float_outputs(node)


#: Why a float8 layer (:class:`mixprec.float8.Float8Linear`, ``Float8Conv1D``) is left as it is.
FLOAT8_REASON = "float8 layer: casts its input and weight to float8 itself (mixprec.float8)"

# Modules whose kernels take a low-precision input with float32 parameters and
# running statistics: a call to one can be painted without casting its state.
_MIXED_DTYPE_MODULES = frozenset({"batch_norm"})


def _blocker(node: fx.Node, root: nn.Module | None, name: str) -> str | None:
    """Why a vertex can never be painted (``None`` when it can)."""
    if node.op == "call_module" and root is not None and name not in _MIXED_DTYPE_MODULES:
        # Imported here: mixprec.float8 loads only when a graph is painted, not with the package.
        from mixprec.float8._linear import Float8Layer

        module = root.get_submodule(str(node.target))
        if isinstance(module, Float8Layer):
            return FLOAT8_REASON
        if _has_float_state(module):
            return (
                "module call with float parameters or buffers inside, which the graph cannot cast"
            )
    if mutated_arg_names(node):
        return "in-place op: keeps the dtype of the tensor it modifies"
    return None


def _walk(
    roots: Iterable[fx.Node],
    step: Callable[[fx.Node], Iterable[fx.Node]],
    enter: Callable[[fx.Node], bool],
    visit: Callable[[fx.Node, fx.Node], None],
) -> None:
    """Depth-first search from each root; ``visit(node, root)`` on each node entered."""
    for root in roots:
        stack = [root]
        seen = {root}
        while stack:
            node = stack.pop()
            visit(node, root)
            for nxt in step(node):
                if nxt not in seen and enter(nxt):
                    seen.add(nxt)
                    stack.append(nxt)


def paint(
    graph: fx.Graph,
    lists: AmpLists,
    dtype: torch.dtype,
    level: str = "default",
    root: nn.Module | None = None,
) -> Painting:
    """Colour every float32-producing op of ``graph`` (algorithm in the module docstring).

    ``root`` is the module owning ``graph``; it is needed to classify ``call_module`` nodes.
    """
    check_level(level)
    vertices = [n for n in graph.nodes if _is_vertex(n, root)]
    vset = set(vertices)
    position = {v: i for i, v in enumerate(vertices)}
    producers: dict[fx.Node, list[fx.Node]] = {v: [] for v in vertices}
    consumers: dict[fx.Node, list[fx.Node]] = {v: [] for v in vertices}
    for v in vertices:
        for arg in v.all_input_nodes:
            source = arg.args[0] if is_tuple_getitem(arg) else arg
            if source in vset and is_float32_tensor(arg) and source not in producers[v]:
                producers[v].append(source)
                consumers[source].append(v)

    op = {v: op_name(v, root) or "?" for v in vertices}
    list_name = {v: lists.list_of(op[v]) for v in vertices}
    blocked = {v: why for v in vertices if (why := _blocker(v, root, op[v])) is not None}
    kind = {v: (None if v in blocked else list_name[v]) for v in vertices}
    if level == "treat_infer_as_deny":
        kind = {v: ("deny" if k == "infer" else k) for v, k in kind.items()}

    low: set[fx.Node] = set()
    rule: dict[fx.Node, str] = {}
    reason: dict[fx.Node, str] = {}

    def where(v: fx.Node) -> str:
        return f"{op[v]} at node {v.name}"

    def mark(v: fx.Node, how: str, why: str) -> None:
        low.add(v)
        rule[v] = how
        reason[v] = f"allow: {why}"

    if level == "unsafe_force_all":
        for v in vertices:
            if v not in blocked:
                mark(v, "level", "level unsafe_force_all converts every op")
    for v in vertices:
        if kind[v] == "allow" and v not in low:
            mark(v, "allow", "on the allow list")

    deny: dict[fx.Node, fx.Node] = {}
    if level in ("default", "treat_infer_as_deny"):
        # 2. Deny spreads forward through infer ops, and through clear ops that lead
        #    (through clear ops) to a deny or infer op.
        fed: set[fx.Node] = set()
        _walk(
            [v for v in vertices if kind[v] in ("deny", "infer")],
            lambda n: producers[n],
            lambda n: n not in fed and kind[n] == "clear",
            lambda n, r: fed.add(n),
        )
        _walk(
            [v for v in vertices if kind[v] == "deny"],
            lambda n: consumers[n],
            lambda n: n not in deny and n in fed,
            lambda n, r: deny.setdefault(n, r),
        )
        # 3. Infer and clear ops on a path from one allow op to another.
        downstream: dict[fx.Node, fx.Node] = {}
        allow_roots = [v for v in vertices if v in low]
        _walk(
            allow_roots,
            lambda n: consumers[n],
            lambda n: n not in low and n not in deny and kind[n] in ("infer", "clear"),
            lambda n, r: downstream.setdefault(n, r) if n is not r else None,
        )
        _walk(
            allow_roots,
            lambda n: producers[n],
            lambda n: n in downstream and n not in low,
            lambda n, r: (
                mark(
                    n,
                    "between-allow",
                    f"on a path between {where(downstream[n])} and {where(r)}",
                )
                if n is not r
                else None
            ),
        )
        # 4 and 5 feed each other: repeat until nothing changes.
        changed = True
        while changed:
            before = len(low)
            _walk(
                sorted(low, key=position.__getitem__),
                lambda n: producers[n] + consumers[n],
                lambda n: n not in low and n not in deny and kind[n] == "clear",
                lambda n, r: (
                    mark(n, "clear-region", f"clear op connected to painted {where(r)}")
                    if n is not r
                    else None
                ),
            )
            for v in vertices:
                if v in low or v in deny or kind[v] != "infer":
                    continue
                fed_by_deny = any(p in deny for p in producers[v])
                painted = [p for p in producers[v] if p in low]
                if painted and not fed_by_deny:
                    mark(v, "follows-allow", f"follows painted {where(painted[0])}")
            changed = len(low) != before

    for v in vertices:
        if v in low:
            continue
        if v in blocked:
            rule[v], reason[v] = "blocked", f"float32: {blocked[v]}"
        elif v in deny:
            root_op = deny[v]
            rule[v] = "deny"
            if root_op is v or kind[v] == "deny":
                reason[v] = (
                    "deny: infer op treated as deny (level treat_infer_as_deny)"
                    if list_name[v] == "infer"
                    else "deny: on the deny list"
                )
            else:
                reason[v] = f"deny: downstream of {where(root_op)}"
        elif kind[v] == "deny":
            rule[v], reason[v] = "deny", "deny: on the deny list"
        elif level == "allow_only" and kind[v] is not None:
            rule[v], reason[v] = "level", "float32: level allow_only converts allow ops only"
        elif kind[v] is None:
            rule[v], reason[v] = "unlisted", "float32: on no list"
        else:
            rule[v] = "no-allow-nearby"
            reason[v] = f"float32: {kind[v]} op with no painted op to follow"
    paths = {v: module_path(v) for v in vertices}
    return Painting(
        graph,
        root,
        lists,
        dtype,
        level,
        vertices,
        low,
        op,
        list_name,
        rule,
        reason,
        producers,
        consumers,
        paths,
    )
