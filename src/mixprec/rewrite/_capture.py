"""Capture a float32 model as a trainable ``torch.fx.GraphModule`` for the rewrite.

Algorithm::

    args = example_inputs as a tuple (views copied: export would guard on their bases)
    model.train(training)                           # mode constants are tied later
    try:   gm = torch.export.export(model, args, dynamic batch dim, strict=False).module()
           (not with float8 layers: each must stay one call, its backward is custom;
            an output export cannot return, such as a Hugging Face cache object, is
            taken apart into its tensors and a Structure that rebuilds it: outputs.py)
    except: try:   gm = symbolic_trace(model) (nn.Linear / nn.Conv* traced through,
                                               float8 layers kept as calls)
            except: raise CaptureError(where each failed, the cause (an output that cannot
                    be rebuilt, data-dependent control flow, other) and its fix)
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

import collections
import copy
import dataclasses
import functools
import os
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from mixprec.rewrite._modes import follow_training_mode
from mixprec.rewrite._nodes import mutated_arg_names
from mixprec.rewrite._outputs import OutputTypeError, Structure, flatten_output, needs_flattening

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
    """A captured model: the graph module and the capture method that worked.

    ``structure`` is set when the model's output had to be taken apart (a cache
    object, a dataclass): the graph then returns the output's tensors, and
    :func:`mixprec.rewrite._outputs.attach_output_structure` puts it together again.
    """

    module: fx.GraphModule
    method: str  # "export" or "symbolic_trace"
    export_error: str | None = None
    structure: Structure | None = None


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


def _location(err: BaseException) -> str | None:
    """``in f() at file.py:12 `code``` for the innermost frame of user code in ``err``."""
    frames = [
        frame
        for frame in traceback.extract_tb(err.__traceback__)
        if not frame.filename.startswith((_TORCH_DIR, _OWN_DIR))
    ]
    if not frames:
        return None
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"in {frame.name}() at {os.path.basename(frame.filename)}:{frame.lineno}{code}"


def _where(err: BaseException) -> str:
    """The innermost frame of user code in ``err``'s traceback, plus the message."""
    message = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if len(message) > 300:
        message = message[:300] + "..."
    location = _location(err)
    return (
        f"{type(err).__name__}: {message}"
        if location is None
        else (f"{location}: {type(err).__name__}: {message}")
    )


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _is_data_dependent(err: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(err, GuardOnDataDependentSymNode):
        return True
    text = str(err)
    return (isinstance(err, fx.proxy.TraceError) and "control flow" in text) or (
        "data-dependent" in text or "data dependent" in text
    )


_O1 = "use module-level mixed precision instead: mixprec.amp.initialize(model, level='O1')"


def _capture_failure(model: nn.Module, export_err: BaseException, fx_err: BaseException) -> str:
    """The capture error's message: both failures, the real cause and its fix."""
    errors = [*_chain(export_err), *_chain(fx_err)]
    output_error = next((e for e in errors if isinstance(e, OutputTypeError)), None)
    shown_export = (
        _where(export_err) if output_error is None else "OutputTypeError: see the cause below"
    )
    head = (
        f"could not capture {type(model).__name__} as one graph.\n"
        f"  torch.export failed {shown_export}\n"
        f"  torch.fx.symbolic_trace failed {_where(fx_err)}\n"
    )
    if output_error is not None:
        return head + f"Cause: {output_error}; or {_O1}."
    flow = next((e for e in errors if _is_data_dependent(e)), None)
    if flow is not None:
        return head + (
            f"Cause: data-dependent Python control flow {_location(flow) or ''}: "
            "the forward branches on the values in a tensor, so no single graph computes "
            "it for every input. Fix: express the branch with tensor ops (torch.where, "
            f"torch.cond), or {_O1}."
        )
    return head + (
        "Cause: the first error above (the graph rewrite needs the whole forward as one "
        "graph). Fix: make the forward traceable by torch.export, or "
        f"{_O1}."
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
    from mixprec.float8._linear import Float8Layer

    return isinstance(module, Float8Layer)


# Hooks of the top module, run by the model's own call inside the shell (below).
_CALL_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks",
)  # fmt: skip


def _flattening_shell(model: nn.Module, found: list[Structure]) -> nn.Module:
    """A module that shares ``model``'s parameters, buffers and submodules (so the graph's
    names and module paths are the model's) and calls the model, returning its output
    taken apart into tensors when ``torch.export`` could not return it as it is."""
    shell = copy.copy(model)  # shares the dicts of parameters, buffers and submodules
    for name in _CALL_HOOKS:
        setattr(shell, name, collections.OrderedDict())

    @functools.wraps(model.forward)  # the same signature: export names inputs by it
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = model(*args, **kwargs)
        if not needs_flattening(out):
            return out
        leaves, structure = flatten_output(out)
        found.append(structure)
        return tuple(leaves)

    shell.forward = forward
    return shell


def _export(model: nn.Module, args: tuple[Any, ...]) -> tuple[fx.GraphModule, Structure | None]:
    from torch.export import export  # loaded where used

    found: list[Structure] = []
    shell = _flattening_shell(model, found)
    program = export(shell, args, dynamic_shapes=_dynamic_batch(args), strict=False)
    unlifted = program.module()
    # A plain GraphModule over the same graph and attributes: the exported
    # module's class forbids train()/eval(), which the rewritten model needs.
    gm = fx.GraphModule(unlifted, unlifted.graph, class_name=type(model).__name__)
    guards = getattr(gm, "_guards_fn", None)
    if isinstance(guards, nn.Module):
        gm._guards_fn = InputGuards(guards, describe_inputs(args, free_batch=True))
    return gm, (found[-1] if found else None)


def describe_inputs(args: tuple[Any, ...], free_batch: bool = False) -> str:
    """The tensors among ``args`` as ``[B, 12] int64, ...``; ``B``: a batch size the
    graph leaves free (``free_batch``: every first dimension but 1, which export fixes).

    >>> describe_inputs((torch.zeros(4, 12, dtype=torch.int64), 3), free_batch=True)
    '[B, 12] int64'
    """
    shapes = []
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            dims = [str(d) for d in leaf.shape]
            if free_batch and dims and leaf.shape[0] > 1:
                dims[0] = "B"
            shapes.append(f"[{', '.join(dims)}] {str(leaf.dtype).removeprefix('torch.')}")
    return ", ".join(shapes) or "no tensors"


class InputGuards(nn.Module):
    """An exported graph's checks of its inputs, failing with what the graph was captured
    for and the fix, where torch's say ``Guard failed: ids.size()[1] == 12`` or cannot
    index a dimension the input lacks. Only a failed check costs anything."""

    def __init__(self, guards: nn.Module, captured: str) -> None:
        super().__init__()
        self.guards, self.captured = guards, captured

    def forward(self, *args: Any) -> Any:
        try:
            return self.guards(*args)
        except (AssertionError, IndexError) as error:
            raise ValueError(
                f"the rewritten graph was captured for inputs {self.captured}"
                f"{' (B: any batch size)' if '[B' in self.captured else ''} and is called "
                f"with {describe_inputs(args)} ({error}); capture with "
                "example inputs of the shapes you call it with, or leave example_inputs out: "
                "rewrite(model, dtype=...) captures a graph for each new shape"
            ) from None


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
    # A view as example input makes torch.export guard on its base tensor's shape, and
    # the graph then refuses inputs that are not views of the same kind: trace a copy.
    args = pytree.tree_map(
        lambda a: a.clone() if isinstance(a, torch.Tensor) and a._base is not None else a, args
    )
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
    structure: Structure | None = None
    try:
        model.train(training)
        try:
            if any(_is_float8_layer(m) for m in model.modules()):
                raise _KeptWhole(
                    "float8 layers stay whole calls, which torch.export cannot keep (it would "
                    "trace through their custom backward)"
                )
            (gm, structure), method = _export(model, args), "export"
        except Exception as err:  # any failure of export sends us to the fallback
            export_error = err
            try:
                gm, method = _symbolic_trace(model, args), "symbolic_trace"
            except Exception as fx_err:
                raise CaptureError(_capture_failure(model, err, fx_err)) from fx_err
    finally:
        for module, mode in modes:
            module.training = mode
    _strip_dtype_assertions(gm.graph)
    follow_training_mode(gm)
    functionalize_inplace(gm.graph)
    gm.graph.lint()
    gm.recompile()
    gm.train(was_training)
    return Captured(gm, method, None if export_error is None else _where(export_error), structure)
