"""The rewrite without example inputs: capture on the first call, as ``torch.compile`` does.

``rewrite(model)`` returns a :class:`LazyRewrite`: the model's own module tree (its
parameters, buffers, submodules and ``state_dict`` keys are the model's) whose
forward runs a rewritten graph. A graph is captured, in the current train/eval mode,
the first time a call's inputs fit none of the graphs captured so far::

    call(*args):
        key <- train/eval mode; per input leaf: tensor dtype, device, shape, or the value
        graph <- the first captured graph whose key matches (a batch dimension that the
                 capture left free matches any batch of 2 or more)
        none:  len(graphs) == max_captures -> RecaptureLimitError (naming what changed)
               graph <- capture and rewrite in the current mode; remember it with its key
        return graph(*args)

Moving or converting the module (``.to()``, ``.cuda()``, ``.half()``...) forgets the
graphs: they hold the tensors of before. ``graph_module`` is the graph of the last
call, for :func:`mixprec.rewrite.explain`.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> from mixprec.rewrite import rewrite
>>> lazy = rewrite(net, dtype=torch.bfloat16)
>>> lazy.captures
0
>>> lazy(torch.randn(5, 4)).dtype, lazy(torch.randn(7, 4)).dtype, lazy.captures
(torch.float32, torch.float32, 1)
>>> _ = lazy.eval()(torch.randn(3, 4)); lazy.captures        # evaluation mode: its own graph
2
>>> sorted(lazy.state_dict()) == sorted(net.state_dict())
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from mixprec.rewrite._capture import CaptureError

#: How many graphs a lazily rewritten model captures before it refuses (torch.compile's
#: recompile limit is also 8).
DEFAULT_MAX_CAPTURES = 8


class RecaptureLimitError(CaptureError):
    """A lazily rewritten model needed more graphs than ``max_captures``."""


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, leaf.device, tuple(leaf.shape))
    return ("value", type(leaf).__name__, leaf)


def _describe(key: tuple[Any, ...]) -> str:
    training, spec, leaves = key
    parts = []
    for leaf in leaves:
        if leaf[0] == "tensor":
            dtype = str(leaf[1]).replace("torch.", "")
            parts.append(f"{dtype}{list(leaf[3])} on {leaf[2]}")
        else:
            parts.append(repr(leaf[2]))
    return f"({', '.join(parts)}) in {'training' if training else 'evaluation'} mode"


class _Graph:
    """A captured graph and the inputs it accepts."""

    def __init__(self, module: fx.GraphModule, key: tuple[Any, ...], free: set[int]) -> None:
        self.module, self.key, self.free = module, key, free

    def accepts(self, key: tuple[Any, ...]) -> bool:
        if key[:2] != self.key[:2] or len(key[2]) != len(self.key[2]):
            return False
        for i, (got, want) in enumerate(zip(key[2], self.key[2])):
            if got[0] != want[0] or got[:-1] != want[:-1]:
                return False
            if got[0] == "value":
                if not _equal_values(got[2], want[2]):
                    return False
            elif got[3] != want[3]:
                # A free batch dimension takes any size torch.export leaves dynamic (>= 2).
                same_rest = len(got[3]) == len(want[3]) and got[3][1:] == want[3][1:]
                if not (i in self.free and same_rest and got[3][0] >= 2):
                    return False
        return True


def _equal_values(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an object without a usable ==: only itself matches
        return a is b


def _free_batch_leaves(module: fx.GraphModule, method: str, leaves: list[Any]) -> set[int]:
    """Indices of the tensor leaves whose first dimension the graph leaves free."""
    tensors = {
        i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1
    }
    if method != "export":
        return tensors  # symbolic_trace records shapes symbolically
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        return set()
    free = set()
    for i in tensors:
        val = placeholders[i].meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(val.shape[0], torch.SymInt):
            free.add(i)
    return free


class LazyRewrite(nn.Module):
    """A model rewritten graph by graph as its calls come (see the module docstring).

    ``build(model, args, training)`` captures and rewrites ``model`` for one call's
    positional arguments and returns ``(graph_module, capture_method)``.
    """

    def __init__(
        self,
        model: nn.Module,
        build: Callable[[nn.Module, tuple[Any, ...], bool], tuple[fx.GraphModule, str]],
        max_captures: int,
    ) -> None:
        super().__init__()
        # The model's own tree: parameters, buffers, submodules and state_dict keys are
        # the model's, and .to()/.train()/load_state_dict reach the model.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        self.training = model.training
        self.__dict__.update(
            _model=model, _build=build, max_captures=max_captures, _graphs=[], _last=None
        )

    @property
    def model(self) -> nn.Module:
        """The model this module rewrites."""
        return self.__dict__["_model"]

    @property
    def captures(self) -> int:
        """How many graphs have been captured (since the last move or conversion)."""
        return len(self.__dict__["_graphs"])

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten graph that the last call ran."""
        last = self.__dict__["_last"]
        if last is None:
            raise ValueError(
                "this lazily rewritten model has not run yet: call it once (it captures "
                "then), or pass example_inputs= to rewrite() to capture at once"
            )
        return last

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None or name.startswith("_"):  # not built yet; private state
                raise
            return getattr(model, name)  # the model's own public attributes and methods

    def train(self, mode: bool = True) -> LazyRewrite:
        super().train(mode)
        self.__dict__["_model"].training = mode
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> LazyRewrite:
        super()._apply(fn, recurse)
        # Captured graphs hold the tensors of before (buffers are replaced, not changed).
        self.__dict__["_graphs"].clear()
        self.__dict__["_last"] = None
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"a rewritten model takes positional arguments only, got keywords "
                f"{sorted(kwargs)}; pass them positionally"
            )
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(args)):
            raise TypeError("a rewritten model's call needs at least one tensor argument")
        leaves, spec = pytree.tree_flatten(args)
        key = (self.training, str(spec), tuple(_leaf_key(leaf) for leaf in leaves))
        graphs: list[_Graph] = self.__dict__["_graphs"]
        graph = next((g for g in graphs if g.accepts(key)), None)
        if graph is None:
            if len(graphs) >= self.max_captures:
                seen = "; ".join(_describe(g.key) for g in graphs)
                raise RecaptureLimitError(
                    f"the rewritten {type(self.model).__name__} has captured "
                    f"max_captures={self.max_captures} graphs and this call fits none of "
                    f"them: {_describe(key)}; captured for: {seen}. Inputs whose shapes, "
                    "dtypes, devices or non-tensor values change from call to call would be "
                    "captured again and again: keep them steady (pad, drop_last=True), pass "
                    "example_inputs= to capture one graph with a free batch size, or raise "
                    "max_captures="
                )
            module, method = self.__dict__["_build"](self.model, args, self.training)
            graph = _Graph(module, key, _free_batch_leaves(module, method, leaves))
            graphs.append(graph)
        self.__dict__["_last"] = graph.module
        return graph.module(*args)

    def extra_repr(self) -> str:
        return f"captures={self.captures}, max_captures={self.max_captures}"
