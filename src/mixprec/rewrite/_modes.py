"""Make a captured graph follow ``.train()`` / ``.eval()`` like the model it came from.

``torch.export`` traces the model once, in training mode, and bakes each mode
switch into the graph as a constant: ``aten.dropout(x, 0.1, True)``,
``aten.batch_norm(..., True, ...)``, ``scaled_dot_product_attention(...,
dropout_p=0.1)`` and the ``num_batches_tracked += 1`` of batch norm. This pass
replaces those constants with the output of a :class:`TrainingFlag` submodule,
which reads the rewritten module's own ``training`` attribute on every call, so
``.train()`` and ``.eval()`` switch the graph like they switch the model::

    flag = TrainingFlag()()                        # inserted once, after the inputs
    dropout(x, p, True)            ->  dropout(x, p, flag)
    lstm(..., dropout=p, train=True) -> lstm(..., train=flag)    (gru, rnn_* too; p > 0)
    batch_norm(..., True, ...)     ->  batch_norm(..., flag, ...)   (running stats only)
    sdpa(..., dropout_p=p)         ->  sdpa(..., dropout_p=p_if_training(p, flag))
    num_batches_tracked.add_(1)    ->  count_batch_if_training(num_batches_tracked, flag)

Python branches on ``self.training`` other than these are traced in training mode.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
>>> gm = torch.export.export(net.train(), (torch.ones(3, 2),), strict=False).module()
>>> gm = torch.fx.GraphModule(gm, gm.graph)
>>> follow_training_mode(gm)
1
>>> _ = gm.eval(); bool(torch.equal(gm(torch.ones(3, 2)), net.eval()(torch.ones(3, 2))))
True
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import fx, nn

FLAG_NAME = "training_flag"

_DROPOUT_OPS = {
    torch.ops.aten.dropout.default: "train",
    torch.ops.aten.feature_dropout.default: "train",
    torch.ops.aten.alpha_dropout.default: "train",
    torch.ops.aten.feature_alpha_dropout.default: "train",
    torch.ops.aten.native_dropout.default: "train",
}
# Recurrent layers apply dropout between stacked layers when their ``train`` argument
# is set; export bakes it in as True.
_RNN_OPS = {
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")
    for overload in ("input", "data")
}
_NORM_OPS = {
    torch.ops.aten.batch_norm.default: "training",
    torch.ops.aten.instance_norm.default: "use_input_stats",
}
_FUNCTIONAL_DROPOUT = (
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
)


class TrainingFlag(nn.Module):
    """A submodule whose call returns whether its parent module is in training mode.

    ``nn.Module.train``/``eval`` set ``training`` on every submodule, so this one
    always agrees with the module that owns the graph.

    >>> TrainingFlag().eval()()
    False
    """

    def forward(self) -> bool:
        return self.training


def p_if_training(p: float, training: bool) -> float:
    """Dropout probability ``p`` in training mode, ``0.0`` in evaluation mode.

    >>> p_if_training(0.1, True), p_if_training(0.1, False)
    (0.1, 0.0)
    """
    return p if training else 0.0


def count_batch_if_training(counter: torch.Tensor, training: bool) -> torch.Tensor:
    """Add one to batch norm's ``num_batches_tracked`` counter in training mode only.

    >>> n = torch.zeros((), dtype=torch.long)
    >>> _ = count_batch_if_training(n, True); _ = count_batch_if_training(n, False); int(n)
    1
    """
    if training:
        counter.add_(1)
    return counter


def _schema_index(op: torch._ops.OpOverload, name: str) -> int:
    return [arg.name for arg in op._schema.arguments].index(name)


def _set_arg(node: fx.Node, index: int, name: str, value: object) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _get_arg(node: fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_num_batches_increment(node: fx.Node) -> bool:
    if node.target is not torch.ops.aten.add_.Tensor or len(node.args) < 2:
        return False
    counter, amount = node.args[0], node.args[1]
    return (
        isinstance(counter, fx.Node)
        and counter.op == "get_attr"
        and str(counter.target).rpartition(".")[2] == "num_batches_tracked"
        and amount == 1
    )


def follow_training_mode(gm: fx.GraphModule) -> int:
    """Tie the mode constants of ``gm``'s graph to ``gm.training``; return how many.

    Adds the :class:`TrainingFlag` submodule only when something depends on it.
    """
    graph = gm.graph
    flag: list[fx.Node] = []

    def flag_node() -> fx.Node:
        if not flag:
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            anchor = placeholders[-1] if placeholders else next(iter(graph.nodes))
            gm.add_submodule(FLAG_NAME, TrainingFlag())
            with graph.inserting_after(anchor):
                flag.append(graph.call_module(FLAG_NAME, ()))
            flag[0].meta["val"] = True
        return flag[0]

    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if target in _DROPOUT_OPS:
            name = _DROPOUT_OPS[target]
            index = _schema_index(target, name)
            if isinstance(_get_arg(node, index, name, None), bool):
                _set_arg(node, index, name, flag_node())
                changed += 1
        elif target in _RNN_OPS:
            index = _schema_index(target, "train")
            dropout = _get_arg(node, _schema_index(target, "dropout"), "dropout", 0.0)
            if isinstance(_get_arg(node, index, "train", None), bool) and dropout:
                _set_arg(node, index, "train", flag_node())
                changed += 1
        elif target in _NORM_OPS:
            # With running statistics absent, batch norm always uses batch statistics.
            name = _NORM_OPS[target]
            running_mean = _get_arg(
                node, _schema_index(target, "running_mean"), "running_mean", None
            )
            if running_mean is not None:
                _set_arg(node, _schema_index(target, name), name, flag_node())
                changed += 1
        elif target is torch.ops.aten.scaled_dot_product_attention.default:
            index = _schema_index(target, "dropout_p")
            p = _get_arg(node, index, "dropout_p", 0.0)
            if isinstance(p, float) and p > 0.0:
                with graph.inserting_before(node):
                    p_node = graph.call_function(p_if_training, (p, flag_node()))
                p_node.meta["val"] = p
                _set_arg(node, index, "dropout_p", p_node)
                changed += 1
        elif _is_num_batches_increment(node):
            with graph.inserting_before(node):
                counted = graph.call_function(count_batch_if_training, (node.args[0], flag_node()))
            counted.meta.update(node.meta)
            node.replace_all_uses_with(counted)
            graph.erase_node(node)
            changed += 1
        elif target in _FUNCTIONAL_DROPOUT:
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
            if isinstance(bound.arguments.get("training", True), bool):
                bound.arguments["training"] = flag_node()
                node.args, node.kwargs = bound.args, bound.kwargs
                changed += 1
    if changed:
        graph.lint()
        gm.recompile()
    return changed
