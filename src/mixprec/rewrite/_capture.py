"""Capture a float32 model as a trainable ``torch.fx.GraphModule`` for the rewrite.

Algorithm::

    args = example_inputs as a tuple
    model.train(training)                           # mode constants are tied later
    try:   gm = torch.export.export(model, args, dynamic batch dim, strict=False).module()
           (not with float8 layers: each must stay one call, its backward is custom)
    except: try:   gm = symbolic_trace(model) (nn.Linear / nn.Conv* traced through,
                                               float8 layers kept as calls)
            except: raise CaptureError(which construct failed in each, what to use instead)
    restore every submodule's previous mode
    drop export's dtype assertions (the rewrite changes dtypes on purpose)
    tie dropout / batch-norm / attention-dropout constants to gm.training  (modes.py)
    turn in-place ops into out-of-place ones where no one can tell the difference

The captured module holds the model's own ``Parameter`` and buffer objects (no
copies), so an optimizer built on ``model.parameters()`` trains it.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(inplace=True))
>>> captured = capture(net, torch.randn(4, 3))
>>> captured.method, captured.module.get_submodule("0").weight is net[0].weight
('export', True)
>>> tuple(captured.module(torch.randn(7, 3)).shape)
(7, 2)
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from mixprec.rewrite._modes import follow_training_mode
from mixprec.rewrite._nodes import mutated_arg_names

__all__ = ["CaptureError", "Captured", "capture", "normalize_example_inputs"]

# Traced through by the fallback tracer, so their weights become graph inputs that
# the rewrite can cast; every other torch.nn module stays one call in the graph.
_TRACE_THROUGH = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(__file__))


class CaptureError(RuntimeError):
    """Neither ``torch.export`` nor ``torch.fx.symbolic_trace`` could capture the model."""


class _KeptWhole(Exception):
    """The model holds modules that must stay one call each: capture by ``symbolic_trace``."""


@dataclasses.dataclass
class Captured:
    """A captured model: the graph module and the capture method that worked."""

    module: fx.GraphModule
    method: str  # "export" or "symbolic_trace"
    export_error: str | None = None


def normalize_example_inputs(example_inputs: Any) -> tuple[Any, ...]:
    """Positional example arguments as a tuple: a tensor, or a tuple/list of arguments.

    >>> len(normalize_example_inputs(torch.ones(2))), len(normalize_example_inputs([torch.ones(2), 3]))
    (1, 2)
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(args)):
            raise TypeError(
                f"example_inputs must contain at least one tensor, got {_describe(args)}; "
                "pass the positional arguments of one forward call, e.g. (x,)"
            )
        return args
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of positional arguments, got "
        f"{_describe(example_inputs)}; e.g. example_inputs=(torch.randn(8, 3, 32, 32),)"
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value)
        return f"({inner},)" if isinstance(value, tuple) else f"[{inner}]"
    return f"{value!r} ({type(value).__name__})"


def _where(err: BaseException) -> str:
    """The innermost frame of user code in ``err``'s traceback, plus the message."""
    frames = [
        frame
        for frame in traceback.extract_tb(err.__traceback__)
        if not frame.filename.startswith((_TORCH_DIR, _OWN_DIR))
    ]
    message = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if len(message) > 300:
        message = message[:300] + "..."
    if not frames:
        return f"{type(err).__name__}: {message}"
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return (
        f"in {frame.name}() at {os.path.basename(frame.filename)}:{frame.lineno}{code}: "
        f"{type(err).__name__}: {message}"
    )


def _dynamic_batch(args: tuple[Any, ...]) -> tuple[Any, ...]:
    from torch.export import Dim  # loaded where used

    def spec(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return {0: Dim.AUTO}
        return None

    return tuple(pytree.tree_map(spec, arg) for arg in args)


def _is_float8_layer(module: nn.Module) -> bool:
    # Imported here: mixprec.float8 loads only when a model is captured, not with the package.
    from mixprec.float8._linear import Float8Linear

    return isinstance(module, Float8Linear)


def _export(model: nn.Module, args: tuple[Any, ...]) -> fx.GraphModule:
    from torch.export import export  # loaded where used

    program = export(model, args, dynamic_shapes=_dynamic_batch(args), strict=False)
    unlifted = program.module()
    # A plain GraphModule over the same graph and attributes: the exported
    # module's class forbids train()/eval(), which the rewritten model needs.
    return fx.GraphModule(unlifted, unlifted.graph, class_name=type(model).__name__)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if _is_float8_layer(m):
            return True  # one call: its float8 backward is a custom autograd function
        if isinstance(m, _TRACE_THROUGH):
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _symbolic_trace(model: nn.Module, args: tuple[Any, ...]) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    # Value dtypes come from one evaluation-mode run on copies of the inputs, so
    # that no running statistic, random state or input is changed by it.
    was_training = gm.training
    copies = pytree.tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)
    try:
        gm.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            ShapeProp(gm).propagate(*copies)
    finally:
        gm.train(was_training)
    return gm


def _strip_dtype_assertions(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)


def _returns_alias(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True  # unknown producers may return views
    return any(ret.alias_info is not None for ret in target._schema.returns)


def functionalize_inplace(graph: fx.Graph) -> int:
    """Replace ``x.op_(...)`` by ``op(x, ...)`` where ``x`` is an intermediate result.

    Later readers of ``x`` are pointed at the new result, which is what they saw
    before. In-place ops on inputs, parameters, buffers or views are kept: their
    side effect is visible outside. Returns the number of ops replaced.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    replaced = 0
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if mutated_arg_names(node) != {"self"} or not node.args:
            continue
        name = target.overloadpacket.__name__
        packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
        functional = getattr(packet, target._overloadname, None) if packet else None
        source = node.args[0]
        if (
            functional is None
            or len(functional._schema.arguments) != len(target._schema.arguments)
            or not isinstance(source, fx.Node)
            or source.op != "call_function"
            or _returns_alias(source)
        ):
            continue
        for user in list(source.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(source, node)
        node.target = functional
        replaced += 1
    return replaced


def capture(
    model: nn.Module, example_inputs: Any, *, training: bool = True, warn_batch: bool = True
) -> Captured:
    """Capture ``model`` as a ``GraphModule`` (see the module docstring for the steps).

    ``training``: the mode the forward is traced in. Training mode (the default)
    gives a graph for both modes (its mode constants follow ``gm.training``); a
    graph traced in evaluation mode is for evaluation (the lazy rewrite captures
    one per mode). ``warn_batch``: warn about an example batch of 0 or 1.
    """
    args = normalize_example_inputs(example_inputs)
    for leaf in pytree.tree_leaves(args) if warn_batch else ():
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] < 2:
            warnings.warn(
                f"an example input has batch size {leaf.shape[0]}; torch.export specializes "
                "sizes 0 and 1, so the rewritten model will accept only that batch size. "
                "Pass an example batch of 2 or more to accept any batch size.",
                UserWarning,
                stacklevel=3,
            )
            break
    # Every submodule's own mode is restored afterwards, not just the top one's.
    modes = [(module, module.training) for module in model.modules()]
    was_training = model.training
    export_error: BaseException | None = None
    try:
        model.train(training)
        try:
            if any(_is_float8_layer(m) for m in model.modules()):
                raise _KeptWhole(
                    "float8 layers stay whole calls, which torch.export cannot keep (it would "
                    "trace through their custom backward)"
                )
            gm, method = _export(model, args), "export"
        except Exception as err:  # any failure of export sends us to the fallback
            export_error = err
            try:
                gm, method = _symbolic_trace(model, args), "symbolic_trace"
            except Exception as fx_err:
                raise CaptureError(
                    f"could not capture {type(model).__name__} as one graph.\n"
                    f"  torch.export failed {_where(err)}\n"
                    f"  torch.fx.symbolic_trace failed {_where(fx_err)}\n"
                    "The graph rewrite needs the whole forward as one graph; data-dependent "
                    "Python control flow prevents that. Use module-level mixed precision "
                    "instead: mixprec.amp.initialize(model, level='O1')."
                ) from fx_err
    finally:
        for module, mode in modes:
            module.training = mode
    _strip_dtype_assertions(gm.graph)
    follow_training_mode(gm)
    functionalize_inplace(gm.graph)
    gm.graph.lint()
    gm.recompile()
    gm.train(was_training)
    return Captured(gm, method, None if export_error is None else _where(export_error))
