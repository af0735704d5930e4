"""Plan the casts a painting needs, and return painted ops to float32 where that saves casts.

Planning, for a set of painted ops::

    delivered(v) = low if v was float32 and is painted, else v's own dtype
    for each use of a float32 value a by an op c (and each graph output):
        wanted = low if c is painted else float32  (graph outputs: float32)
        skip: arguments written in place, batch-norm weight/bias/running stats,
              shape queries, user casts, clear ops with non-float outputs
        skip: c is a float32 add/sub/mul/div/maximum/minimum and another input is a
              float32 tensor with dimensions: the kernel promotes, no cast kernel runs
        a user cast x.float() of a low value, wanted low again -> use the low value
        an existing user cast of a to `wanted` -> reuse it
        otherwise -> one cast (a, wanted), shared by every use that wants it
    user casts whose input already has their dtype are redundant and dropped
    a painted linear/conv whose every consumer wants float32, one of them by a cast,
        drops its bias and adds it in float32 afterwards (type promotion gives the
        float32 result): no cast of the bias, no cast of the output. Where every such
        consumer promotes (a residual add), the bias stays in the op, cast as
        autocast casts it: the output is written and read in low precision, not float32

Refinement (``minimize_casts``)::

    repeat until nothing changes, over the ops painted only by the clear-region /
    follows-allow rules, in graph order:
        each that reads or feeds a float32 value, alone, back in float32
        only when none of those saves a kernel: each with the flexible ops it feeds
        keep a change when the plan needs fewer kernels (casts and bias adds)

>>> import torch
>>> from mixprec.rewrite._lists import AmpLists
>>> from mixprec.rewrite._paint import paint
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x"); w = g.placeholder("w")
>>> mm = g.call_function(torch.ops.aten.mm.default, (x, w))
>>> out = g.output(mm)
>>> for n in (x, w, mm): n.meta["val"] = torch.empty(2, 2)
>>> plan = plan_casts(paint(g, AmpLists(), torch.bfloat16), keep_output_dtype=False)
>>> sorted((a.name, str(d)) for a, d in plan.casts), plan.cost
([('mm_default', 'torch.float32'), ('w', 'torch.bfloat16'), ('x', 'torch.bfloat16')], 3)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from mixprec.rewrite._nodes import (
    PROMOTING,
    SHAPE_ONLY,
    arg_items,
    cast_target,
    is_tuple_getitem,
    mutated_arg_names,
    op_name,
    state_arg_names,
    tensor_dtype,
    tensor_ndim,
)
from mixprec.rewrite._paint import Painting

_F32 = torch.float32
_BIAS_OPS = frozenset({"linear", "conv1d", "conv2d", "conv3d"})


@dataclasses.dataclass
class CastPlan:
    """Where casts go for one colouring of the graph."""

    low: set[fx.Node]
    casts: dict[tuple[fx.Node, torch.dtype], list[fx.Node]]
    rewire: dict[tuple[fx.Node, fx.Node], fx.Node]
    redundant: set[fx.Node]
    active_user_casts: set[fx.Node]
    bias_splits: set[fx.Node]
    exempt: dict[fx.Node, frozenset[str]]

    @property
    def cost(self) -> int:
        """Kernels the plan adds to one forward pass: new casts, user casts that now
        convert, and each split bias's float32 add (the op no longer adds it: a kernel
        as much as the bias cast it saves)."""
        return len(self.casts) + len(self.active_user_casts) + len(self.bias_splits)


def _node_args(value: object) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def plan_casts(
    painting: Painting, keep_output_dtype: bool, low: set[fx.Node] | None = None
) -> CastPlan:
    """Plan casts for ``low`` (default: the painting's painted ops); see the module docstring."""
    dtype = painting.dtype
    low = set(painting.low if low is None else low)
    vertices = set(painting.vertices)
    graph_nodes = list(painting.graph.nodes)
    order = {n: i for i, n in enumerate(graph_nodes)}
    delivered: dict[fx.Node, torch.dtype | None] = {}
    redundant: set[fx.Node] = set()
    names = {n: (painting.op.get(n) or op_name(n, painting.root)) for n in graph_nodes}
    exempt: dict[fx.Node, frozenset[str]] = {}

    # Colours in graph order: in-place ops follow the tensor they modify; user
    # casts deliver their dtype, or are redundant when the input already has it.
    for n in graph_nodes:
        original = tensor_dtype(n)
        mutated = mutated_arg_names(n)
        exempt[n] = frozenset(mutated)
        if n in vertices and mutated:
            target = next((a for k, v in arg_items(n) if k in mutated for a in _node_args(v)), None)
            if target is not None and delivered.get(target) == dtype:
                low.add(n)
        if n in low:
            exempt[n] = exempt[n] | state_arg_names(n, names[n])
        cast_to = cast_target(n)
        if cast_to is not None:
            source = n.args[0]
            delivered[n] = cast_to
            if isinstance(source, fx.Node) and delivered.get(source) == cast_to:
                redundant.add(n)
        elif original is None:
            delivered[n] = None
        elif original == _F32 and (n in low or (is_tuple_getitem(n) and n.args[0] in low)):
            delivered[n] = dtype
        else:
            delivered[n] = original

    def wanted(consumer: fx.Node, value: fx.Node) -> torch.dtype | None:
        if tensor_dtype(value) != _F32:
            return None
        if consumer.op == "output":
            return None if keep_output_dtype else _F32
        if consumer.op not in ("call_function", "call_method", "call_module"):
            return None
        name = names.get(consumer)
        if name in SHAPE_ONLY or cast_target(consumer) is not None or is_tuple_getitem(consumer):
            return None
        if consumer in vertices:
            return dtype if consumer in low else _F32
        # Non-float results: clear ops (comparisons, argmax) read any dtype.
        return None if name and painting.lists.list_of(name) == "clear" else _F32

    def uses_of(consumer: fx.Node) -> list[fx.Node]:
        return [a for k, v in arg_items(consumer) if k not in exempt.get(consumer, ())
                for a in _node_args(v)]  # fmt: skip

    def promotes(consumer: fx.Node, uses: list[fx.Node], besides: fx.Node | None = None) -> bool:
        """Whether float32 ``consumer``'s kernel promotes a low-precision operand
        itself: a float32 add/sub/mul/... with a float32 operand with dimensions among
        ``uses`` (other than ``besides``), so no cast kernel runs for it."""
        return (
            consumer not in low
            and names.get(consumer) in PROMOTING
            and any(
                a is not besides and a not in redundant and delivered.get(a) == _F32
                and tensor_dtype(a) == _F32 and (tensor_ndim(a) or 0) >= 1
                for a in uses
            )
        )  # fmt: skip

    # A painted linear/conv whose consumers all want float32, one by a cast, adds its
    # bias after. Where they all promote, the float32 bias add would write and read the
    # output in float32 to save one cast of a bias: more bytes, as many kernels.
    bias_splits: set[fx.Node] = set()
    for v in low:
        if names.get(v) not in _BIAS_OPS or v.op != "call_function":
            continue
        bias = dict(arg_items(v)).get("bias")
        wants = [wanted(u, v) for u in v.users]
        if (
            isinstance(bias, fx.Node)
            and delivered.get(bias) == _F32
            and tensor_ndim(bias) == 1
            and _F32 in wants
            and dtype not in wants
            and not all(promotes(u, uses_of(u), besides=v)
                        for u in v.users if wanted(u, v) == _F32)  # fmt: skip
        ):
            bias_splits.add(v)
            exempt[v] = exempt[v] | {"bias"}
    for v in bias_splits:
        delivered[v] = _F32

    casts: dict[tuple[fx.Node, torch.dtype], list[fx.Node]] = {}
    rewire: dict[tuple[fx.Node, fx.Node], fx.Node] = {}
    used_user_casts: set[fx.Node] = set()
    for consumer in graph_nodes:
        if consumer in redundant:
            continue
        uses = uses_of(consumer)
        promoted = promotes(consumer, uses)
        for value in dict.fromkeys(uses):
            source = value
            while source in redundant:
                source = source.args[0]
            want = wanted(consumer, value)
            if source is not value:
                rewire[(consumer, value)] = source
            have = delivered.get(source)
            if want is None or have is None or have == want:
                if source is value and cast_target(value) is not None:
                    used_user_casts.add(value)
                continue
            if promoted and want == _F32 and have != _F32:
                continue
            origin = source.args[0] if cast_target(source) is not None else None
            if isinstance(origin, fx.Node) and delivered.get(origin) == want and have == _F32:
                rewire[(consumer, value)] = origin  # low -> float32 -> low is exact
                continue
            reuse = next(
                (
                    u
                    for u in source.users
                    if cast_target(u) == want and u not in redundant and order[u] < order[consumer]
                ),
                None,
            )
            if reuse is not None:
                rewire[(consumer, value)] = reuse
                used_user_casts.add(reuse)
                continue
            casts.setdefault((source, want), []).append(consumer)
            if cast_target(source) is not None:
                used_user_casts.add(source)
    active = {
        u
        for u in used_user_casts
        if isinstance(u.args[0], fx.Node) and delivered.get(u.args[0]) != cast_target(u)
    }
    return CastPlan(low, casts, rewire, redundant, active, bias_splits, exempt)


def _downstream_flexible(v: fx.Node, flexible: set[fx.Node], painting: Painting) -> set[fx.Node]:
    region = {v}
    stack = [v]
    while stack:
        for nxt in painting.consumers[stack.pop()]:
            if nxt in flexible and nxt not in region:
                region.add(nxt)
                stack.append(nxt)
    return region


def _meets_float32(v: fx.Node, low: set[fx.Node]) -> bool:
    """Whether painted ``v`` reads a float32 value or feeds a float32 user.

    Only such ops (or regions holding one) can save casts by turning float32.
    """
    for arg in v.all_input_nodes:
        source = arg.args[0] if is_tuple_getitem(arg) else arg
        if tensor_dtype(arg) == _F32 and source not in low:
            return True
    users = [u for user in v.users for u in (user.users if is_tuple_getitem(user) else [user])]
    return any(u not in low for u in users)


def minimize_casts(
    painting: Painting, keep_output_dtype: bool
) -> tuple[CastPlan, dict[fx.Node, int]]:
    """Return painted ops to float32 where that saves casts; the plan and the savings.

    Only ops painted by the clear-region and follows-allow rules are candidates:
    Allow ops and ops between two Allow ops keep their colour.
    """
    low = set(painting.low)
    plan = plan_casts(painting, keep_output_dtype, low)
    saved: dict[fx.Node, int] = {}
    order = {v: i for i, v in enumerate(painting.vertices)}
    improved = True
    while improved:
        improved = False
        flexible = painting.flexible() & low
        # Single ops first, in graph order; a region only when no single op saves a
        # kernel: it returns every op it holds to float32, and a float32 op moves twice
        # the bytes (a residual stream turned float32 op by op keeps the branches that
        # feed it in low precision, as autocast does).
        for regions in (False, True):
            for v in sorted(flexible, key=order.__getitem__):
                if v not in low:
                    continue
                if not regions:
                    group = {v}
                    if not _meets_float32(v, low):
                        continue
                else:
                    group = _downstream_flexible(v, flexible & low, painting)
                    if len(group) == 1 or not any(_meets_float32(u, low) for u in group):
                        continue
                trial = plan_casts(painting, keep_output_dtype, low - group)
                if trial.cost < plan.cost:
                    for member in group:
                        saved[member] = plan.cost - trial.cost
                    low -= group
                    plan = trial
                    improved = True
            if improved:
                break
    return plan, saved
