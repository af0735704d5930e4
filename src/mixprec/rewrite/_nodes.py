"""What a graph node is, as the rewrite sees it: its op name, value dtypes and arguments.

Both capture paths are read through these helpers: ``torch.export`` graphs of ATen
ops (values in ``node.meta["val"]``) and ``torch.fx.symbolic_trace`` graphs of
Python callables, methods and modules (values in ``node.meta["tensor_meta"]``).

>>> import torch
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x")
>>> y = g.call_function(torch.ops.aten.relu_.default, (x,))
>>> y.meta["val"] = torch.empty(2, 3)
>>> op_name(y), tensor_dtype(y), mutated_arg_names(y)
('relu', torch.float32, {'self'})
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from mixprec.rewrite._lists import normalize_op_name

# Ops that only read a tensor's shape or metadata: they accept any dtype.
SHAPE_ONLY = frozenset(
    {
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "size",
        "stride",
        "dim",
        "numel",
        "getattr",
        "_assert_scalar",
        "_assert_tensor_metadata",
        "sym_constrain_range",
        "sym_constrain_range_for_size",
        "_guards_fn",
    }
)

# Elementwise ops whose result dtype follows type promotion: with one float32
# operand that has dimensions, a low-precision operand is read in float32 by the
# kernel itself, so a float32 op of this kind needs no cast kernel on that edge.
PROMOTING = frozenset({"add", "sub", "mul", "div", "true_divide", "maximum", "minimum"})

# Arguments of normalisation ops that stay float32 even when the op runs in low
# precision: the kernels take mixed dtypes, and the running statistics are
# updated in place, which a cast copy would lose.
_STATE_ARGS = frozenset({"weight", "bias", "running_mean", "running_var"})
_STATEFUL_OPS = frozenset(
    {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "instance_norm"}
)

_FUNCTION_NAMES: dict[Any, str] = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.isub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    operator.matmul: "matmul",
    operator.neg: "neg",
    operator.abs: "abs",
    operator.pow: "pow",
    operator.getitem: "getitem",
    getattr: "getattr",
    F.cross_entropy: "cross_entropy_loss",
    F.max_pool1d: "max_pool1d",
    F.max_pool2d: "max_pool2d",
    F.max_pool3d: "max_pool3d",
    F.adaptive_max_pool1d: "adaptive_max_pool1d",
    F.adaptive_max_pool2d: "adaptive_max_pool2d",
    F.dropout1d: "feature_dropout",
    F.dropout2d: "feature_dropout",
    F.dropout3d: "feature_dropout",
}

_MODULE_NAMES: dict[type, str] = {
    nn.Linear: "linear",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d",
    nn.ReLU: "relu",
    nn.ReLU6: "relu6",
    nn.GELU: "gelu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.SiLU: "silu",
    nn.ELU: "elu",
    nn.LeakyReLU: "leaky_relu",
    nn.Softplus: "softplus",
    nn.Hardswish: "hardswish",
    nn.Mish: "mish",
    nn.Softmax: "softmax",
    nn.LogSoftmax: "log_softmax",
    nn.Dropout: "dropout",
    nn.Dropout1d: "feature_dropout",
    nn.Dropout2d: "feature_dropout",
    nn.Dropout3d: "feature_dropout",
    nn.AlphaDropout: "alpha_dropout",
    nn.BatchNorm1d: "batch_norm",
    nn.BatchNorm2d: "batch_norm",
    nn.BatchNorm3d: "batch_norm",
    nn.LayerNorm: "layer_norm",
    nn.GroupNorm: "group_norm",
    nn.InstanceNorm1d: "instance_norm",
    nn.InstanceNorm2d: "instance_norm",
    nn.InstanceNorm3d: "instance_norm",
    nn.MaxPool1d: "max_pool1d",
    nn.MaxPool2d: "max_pool2d",
    nn.MaxPool3d: "max_pool3d",
    nn.AvgPool1d: "avg_pool1d",
    nn.AvgPool2d: "avg_pool2d",
    nn.AvgPool3d: "avg_pool3d",
    nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.AdaptiveMaxPool2d: "adaptive_max_pool2d",
    nn.Flatten: "flatten",
    nn.Unflatten: "unflatten",
    nn.Identity: "alias",
    nn.Embedding: "embedding",
    nn.MultiheadAttention: "multihead_attention",
    nn.LSTM: "lstm",
    nn.GRU: "gru",
    nn.LSTMCell: "lstm_cell",
    nn.GRUCell: "gru_cell",
    nn.CrossEntropyLoss: "cross_entropy_loss",
    nn.NLLLoss: "nll_loss",
    nn.MSELoss: "mse_loss",
    nn.L1Loss: "l1_loss",
    nn.SmoothL1Loss: "smooth_l1_loss",
    nn.BCELoss: "binary_cross_entropy",
    nn.BCEWithLogitsLoss: "binary_cross_entropy_with_logits",
    nn.KLDivLoss: "kl_div",
}

_CAST_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def op_name(node: Node, root: nn.Module | None = None) -> str | None:
    """The short op name of a call node (see :mod:`mixprec.rewrite._lists`), else ``None``."""
    target = node.target
    if node.op == "call_function":
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            packet = target.overloadpacket if hasattr(target, "overloadpacket") else target
            return normalize_op_name(packet.__name__)
        if target in _FUNCTION_NAMES:
            return _FUNCTION_NAMES[target]
        return normalize_op_name(getattr(target, "__name__", str(target)).lstrip("_") or "?")
    if node.op == "call_method":
        return normalize_op_name(str(target))
    if node.op == "call_module":
        if target == "_guards_fn":
            return "_guards_fn"
        module = root.get_submodule(str(target)) if root is not None else None
        if module is None:
            return None
        if isinstance(module, (nn.RNN, nn.RNNCell)):  # the op depends on the nonlinearity
            return f"rnn_{module.nonlinearity}" + (
                "_cell" if isinstance(module, nn.RNNCell) else ""
            )
        for cls in type(module).__mro__:
            if cls in _MODULE_NAMES:
                return _MODULE_NAMES[cls]
        return _snake(type(module).__name__)
    return None


def module_path(node: Node) -> str:
    """Dotted path of the user's module that produced ``node`` (``""`` for the top level)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        if isinstance(path, str) and not path.startswith("_empty_nn_module_stack"):
            return path
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    return ""


def _value(node: Any) -> Any:
    if not isinstance(node, Node):
        return None
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("tensor_meta")


def _is_tensor_like(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, type)
    )


def tensor_dtype(node: Any) -> torch.dtype | None:
    """Dtype of the tensor a node produces (``None`` for non-tensors and tuples)."""
    value = _value(node)
    return value.dtype if _is_tensor_like(value) else None


def tensor_ndim(node: Any) -> int | None:
    """Number of dimensions of the tensor a node produces (``None`` for non-tensors)."""
    value = _value(node)
    return len(value.shape) if _is_tensor_like(value) else None


def is_float32_tensor(node: Any) -> bool:
    """Whether ``node`` produces one float32 tensor."""
    return tensor_dtype(node) == torch.float32


def float_outputs(node: Node) -> bool:
    """Whether ``node`` produces float32 tensors (alone or inside a tuple or list)."""
    value = _value(node)
    if _is_tensor_like(value):
        return value.dtype == torch.float32
    if isinstance(value, (tuple, list)):
        return any(_is_tensor_like(v) and v.dtype == torch.float32 for v in value)
    return False


def is_tuple_getitem(node: Node) -> bool:
    """Whether ``node`` picks one element out of an op's tuple of outputs."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source = node.args[0]
    return isinstance(source, Node) and isinstance(_value(source), (tuple, list))


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups")
# Builtins without an inspectable signature.
_BUILTIN_ARGS: dict[Any, tuple[str, ...]] = {
    F.linear: ("input", "weight", "bias"),
    F.conv1d: _CONV_ARGS,
    F.conv2d: _CONV_ARGS,
    F.conv3d: _CONV_ARGS,
    F.conv_transpose1d: _CONV_T_ARGS,
    F.conv_transpose2d: _CONV_T_ARGS,
    F.conv_transpose3d: _CONV_T_ARGS,
}


def _arg_names(node: Node) -> list[str]:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return [arg.name for arg in target._schema.arguments]
    if node.op == "call_function" and target in _BUILTIN_ARGS:
        return list(_BUILTIN_ARGS[target])
    if node.op == "call_function" and callable(target):
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            return []
        return [name for name, p in params.items() if p.kind is not p.VAR_POSITIONAL]
    return []


def arg_items(node: Node) -> Iterator[tuple[str, Any]]:
    """``(argument name, value)`` for each argument; unnamed ones are ``"arg<i>"``."""
    names = _arg_names(node)
    for i, value in enumerate(node.args):
        yield (names[i] if i < len(names) else f"arg{i}"), value
    yield from node.kwargs.items()


def mutated_arg_names(node: Node) -> set[str]:
    """Names of the arguments an ATen op writes to in place."""
    target = node.target
    if node.op == "call_method" and str(target).endswith("_") and not str(target).endswith("__"):
        return {"arg0"}
    if not isinstance(target, torch._ops.OpOverload):
        return set()
    return {
        arg.name
        for arg in target._schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    }


def state_arg_names(node: Node, name: str | None) -> frozenset[str]:
    """Arguments that keep float32 when the op runs in low precision (norm statistics)."""
    return _STATE_ARGS if name in _STATEFUL_OPS else frozenset()


def cast_target(node: Node) -> torch.dtype | None:
    """The dtype a user-written cast converts to (``None`` when ``node`` is not a cast).

    Only pure dtype casts count: ``x.float()``, ``x.to(torch.float16)``,
    ``aten.to.dtype``, ``aten._to_copy(x, dtype=...)`` without a device change.
    """
    target = node.target
    if node.op == "call_function":
        if target is torch.ops.aten.to.dtype:
            return _dtype_arg(node, 1, "dtype")
        if target is torch.ops.aten._to_copy.default:
            if set(node.kwargs) - {"dtype", "memory_format"} or len(node.args) != 1:
                return None
            return node.kwargs.get("dtype")
        return None
    if node.op == "call_method":
        if target in _CAST_METHODS and len(node.args) == 1 and not node.kwargs:
            return _CAST_METHODS[str(target)]
        if target == "to" and set(node.kwargs) <= {"dtype"}:
            return _dtype_arg(node, 1, "dtype")
    return None


def _dtype_arg(node: Node, index: int, name: str) -> torch.dtype | None:
    value = node.args[index] if len(node.args) > index else node.kwargs.get(name)
    if len(node.args) > index + 1 and node.op == "call_method":
        return None
    return value if isinstance(value, torch.dtype) else None
