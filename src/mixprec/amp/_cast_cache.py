"""The cast cache of the amp hooks, and the per-thread call state it is valid for.

One cast per parameter per forward pass of the model, not per call (the lifetime of
``torch.autocast``'s cache). The outermost region entered on a thread opens a pass
(a fresh token); an entry is reused only within the pass that made it, while the
parameter's ``_version`` and storage are unchanged and while it suits the grad mode.
The pass's end (the outermost region's post-hook) empties the caches that the
pass filled, so nothing outlives it: no cast is kept between steps, and an
optimizer step or an edit through ``param.data`` between two forwards is always
seen. Under ``torch.compile`` the cache is not used (see :mod:`mixprec.amp._traced_hooks`).

>>> import torch
>>> cache, w = _CastCache(), torch.nn.Parameter(torch.ones(2))
>>> _local.pass_token = object()
>>> cache.get("w", w, torch.bfloat16) is cache.get("w", w, torch.bfloat16)
True
>>> _local.pass_token = None; _end_pass(); cache._entries
{}
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from mixprec.policy import cast_floating


class _ThreadState(threading.local):
    """Per-thread call state (like ``torch.autocast``'s): the stack of region dtypes
    being run, the token of the forward pass that the cast cache is valid for, and the
    function lists of the active function-cast mode. Every field exists from the start
    (no ``getattr`` defaults), so what ``torch.compile`` guards on stays the same
    from call to call. Per-call state lives in lists that are mutated, never in
    attributes that are reassigned: when ``torch.compile(model)`` compiles the root's
    hooks as frames of their own, Dynamo replays a list's ``append``/``pop`` after the
    frame but drops an attribute assignment on a thread-local object."""

    def __init__(self) -> None:
        self.stack: list[torch.dtype] = []
        self.pass_token: object | None = None
        self.functions: list[Any] = []  # FunctionLists of the active mode (at most one)
        # O1's autocast entries, innermost last: (device type, dtype, enabled, whether
        # this entry entered _AUTOCAST_MODE, under Dynamo).
        self.autocast: list[tuple[str, torch.dtype, bool, bool]] = []
        self.caches: list[_CastCache] = []  # the caches holding casts of this pass


_local = _ThreadState()


def _region_stack() -> list[torch.dtype]:
    return _local.stack


def _current_pass() -> object | None:
    return _local.pass_token


def _end_pass() -> None:
    """Drop every cast the forward pass that just ended cached (see _CastCache)."""
    caches = _local.caches
    for cache in caches:
        cache._entries.clear()
        cache._pass = None
    caches.clear()


class _CastCache:
    """Casts of parameters, reused within one forward pass while the parameter is
    unchanged, and dropped when the pass ends (see module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple] = {}
        self._pass: object | None = None  # the pass whose casts _entries holds

    def get(self, key: Any, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        needs_grad = param.requires_grad and torch.is_grad_enabled()
        token = _current_pass()
        if token is None:  # called outside any region: nothing to share the cast with
            return param.to(dtype)
        entry = self._entries.get(key)
        if entry is not None:
            owner, version, ptr, made_in, cast = entry
            if (
                owner is param
                and made_in is token
                and version == param._version
                and ptr == param.data_ptr()
                and cast.dtype == dtype
                and (cast.requires_grad or not needs_grad)
                # An inference-mode cast cannot take part in autograd later.
                and (not cast.is_inference() or torch.is_inference_mode_enabled())
            ):
                return cast
        cast = param.to(dtype)
        if needs_grad or entry is None or entry[3] is not token or not entry[-1].requires_grad:
            # Keep a differentiable cast over a no-grad one of the same pass.
            self._entries[key] = (param, param._version, param.data_ptr(), token, cast)
            if self._pass is not token:  # the pass's end empties this cache
                self._pass = token
                _local.caches.append(self)
        return cast

    def cast_args(self, tree: Any, dtype: torch.dtype) -> Any:
        """``cast_floating(tree, dtype)``, with parameters taken from the cache."""
        if isinstance(tree, nn.Parameter) and tree.is_floating_point() and tree.dtype != dtype:
            return self.get(id(tree), tree, dtype)
        if isinstance(tree, (list, tuple, dict)):
            if isinstance(tree, dict):
                entries = {k: self.cast_args(v, dtype) for k, v in tree.items()}
                return entries if any(entries[k] is not v for k, v in tree.items()) else tree
            items = [self.cast_args(v, dtype) for v in tree]
            if all(a is b for a, b in zip(items, tree)):
                return tree
            return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
        return cast_floating(tree, dtype)

    # The cache holds non-leaf tensors that cannot be deep-copied or pickled, and
    # they would be stale in a copy anyway: copies start empty.
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._entries, self._pass = {}, None
