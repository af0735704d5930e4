"""The forward hooks that make a module compute in its dtype, and their cast cache.

Every module that a policy covers and that holds parameters carries one
:class:`ModuleAmp` (in ``module.__dict__``) with a forward pre-hook and an
always-called forward hook. A module given a policy of its own (an *owner*)
additionally casts its output and covers every parameter of its *region*: its
subtree up to the next owner. Per call::

    pre-hook(module, args, kwargs):
        args, kwargs <- floating tensors cast to compute dtype
        for each member m of the region (an owner: all members; else: itself):
            shadow(m): for each parameter w of m whose dtype != compute dtype:
                m.__dict__[name] <- cache.get(w)          # attribute lookup finds this first
        owner: push compute dtype on the region stack; enter the function-cast mode
    forward(...)                                          # reads self.weight -> the cast
    post-hook(module, args, output):                      # runs on exceptions too
        undo the above
        owner, output dtype != compute dtype: output <- floating tensors cast to it

Shadowing through ``__dict__`` covers modules that read parameters of submodules
they never call (``nn.MultiheadAttention`` passes ``self.out_proj.weight`` to
``F.multi_head_attention_forward``): the owner shadows its whole region. The
parameters themselves, their gradients and the optimizer never see a low-precision
copy; gradients reach the float32 parameters through the cast.

Cast cache: one cast per parameter per forward pass of the model, not per call
(the lifetime of ``torch.autocast``'s cache). The outermost region entered on a
thread opens a pass; an entry is reused only within the pass that made it, while
the parameter's ``_version`` and storage are unchanged and while it suits the grad
mode. Nothing outlives the pass, so an optimizer step (fused ones update without a
version bump) or an edit through ``param.data`` between two forwards is always
seen, and no process-wide hook or counter is needed: the state is the model's.

A hook registered after amp's sees what the layer computes with:

>>> import torch
>>> from mixprec.amp import set_policy
>>> lin = torch.nn.Linear(2, 2)
>>> set_policy(lin, "mixed_bfloat16")
>>> seen = []
>>> _ = lin.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
>>> _ = lin(torch.ones(1, 2))
>>> seen, lin.weight.dtype
([(torch.bfloat16, torch.bfloat16)], torch.float32)

The hooks keep per-call state per module object, so ``nn.DataParallel`` replicas
work; two threads running the *same* module object at once do not.

Under ``torch.compile`` and ``torch.export`` the hooks hand over to
:mod:`mixprec.amp.traced_hooks`: the same casts, without the cache and the identity
tests that would break the graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.amp import traced_hooks
from mixprec.amp.cast_cache import _CastCache, _local, _region_stack
from mixprec.policy import Policy, cast_floating

__all__ = [
    "ATTR",
    "ModuleAmp",
    "FunctionLists",
    "get_state",
    "forget_regions",
    "region_members",
]

#: Name of the per-module state in ``module.__dict__``.
ATTR = "_mixprec_amp"


def forget_regions(root: nn.Module) -> None:
    """Drop the cached region lists that a policy change under ``root`` makes stale:
    those of the owners in ``root``'s subtree and of the owners whose regions reach
    into it."""
    for module in root.modules():
        state = get_state(module)
        if state is not None:
            state._members = None
            if state.region_owner is not None:
                state.region_owner._members = None


def get_state(module: nn.Module) -> ModuleAmp | None:
    """The amp state of ``module`` (``None`` when no policy covers it)."""
    return module.__dict__.get(ATTR)


def region_members(owner: nn.Module) -> list[nn.Module]:
    """``owner`` and the modules with amp state below it, up to (excluding) other owners."""
    members, seen = [owner], {id(owner)}
    stack = list(owner._modules.values())
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        state = get_state(module)
        if state is not None and state.policy is not None:
            continue  # a nested owner runs its own region
        if state is not None:
            members.append(module)
        stack.extend(module._modules.values())
    return members


class FunctionLists:
    """Torch functions to run in low precision / float32, whatever region they are in.

    ``keep_outputs`` (level O1): a listed function's outputs stay in the dtype it ran
    in, as under ``torch.autocast``; otherwise they go back to the region's dtype.
    """

    def __init__(
        self,
        low: frozenset,
        high: frozenset,
        low_dtype: torch.dtype,
        *,
        keep_outputs: bool = False,
    ) -> None:
        self.low, self.high, self.low_dtype = low, high, low_dtype
        self.keep_outputs = keep_outputs


class _FunctionCastMode(TorchFunctionMode):
    """Casts the arguments of listed torch functions for the forward of one model.

    An allow-listed function runs in the low dtype and a deny-listed one in float32.
    With ``keep_outputs`` (O1, as ``torch.autocast``) its inputs are cast whatever
    region it is in and its outputs stay in that dtype, so a chain of allow-listed
    ops casts once. Otherwise only a function in a region of the other dtype is
    cast, and its floating outputs go back to the region's dtype, so the code around
    the call sees what it would have seen without amp. ``out=`` calls run as given.
    """

    def __init__(self, lists: FunctionLists, cache: _CastCache) -> None:
        super().__init__()
        self.lists, self.cache = lists, cache

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Read through the thread state, not self: Dynamo cannot guard on the
        # attributes of a mode that was on the stack before it started tracing.
        lists = _local.functions[-1]
        target = (
            lists.low_dtype if func in lists.low else torch.float32 if func in lists.high else None
        )
        stack = _region_stack()
        if target is None or not stack or "out" in kwargs:
            return func(*args, **kwargs)
        if lists.keep_outputs:
            if torch.compiler.is_compiling():
                args, kwargs = traced_hooks.cast_tree((args, kwargs), target)
            elif _needs_cast((args, kwargs), target):  # usually not: the region cast them
                args, kwargs = self.cache.cast_args((args, kwargs), target)
            return func(*args, **kwargs)
        region = stack[-1]
        if region == target:
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():  # the graph is the cache (see traced_hooks)
            args, kwargs = traced_hooks.cast_tree((args, kwargs), target)
            return traced_hooks.cast_tree(func(*args, **kwargs), region)
        args, kwargs = self.cache.cast_args((args, kwargs), target)
        return cast_floating(func(*args, **kwargs), region)


def _needs_cast(tree: Any, dtype: torch.dtype) -> bool:
    """Whether ``tree`` holds a floating tensor of another dtype (no copies made)."""
    if isinstance(tree, torch.Tensor):
        return tree.is_floating_point() and tree.dtype != dtype
    if isinstance(tree, (list, tuple)):
        return any(_needs_cast(item, dtype) for item in tree)
    if isinstance(tree, dict):
        return any(_needs_cast(item, dtype) for item in tree.values())
    return False


class ModuleAmp:
    """What one module computes in, and the hooks that make it so.

    ``policy`` is set on owners (modules given a policy of their own, by
    ``set_policy``, ``to_float`` or ``amp.initialize``); members of an owner's region
    have only ``compute_dtype``. ``user_policy`` tells a policy set by the user from
    one ``amp.initialize`` derived from a level; ``level`` is set on the model root
    that ``amp.initialize`` configured.
    """

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype
        self.policy: Policy | None = None
        self.user_policy = False
        self.level: str | None = None
        self._functions: FunctionLists | None = None
        self._mode: _FunctionCastMode | None = None
        # Modules whose running statistics are updated in place (BatchNorm,
        # InstanceNorm) keep their parameters as stored: their kernels take
        # low-precision input with float32 weights and statistics, while a cast
        # weight next to float32 statistics is rejected.
        self.shadow_params = True
        self._cache = _CastCache()
        # Per-call bookkeeping is keyed by the module object: nn.DataParallel
        # replicas share this state (they copy the module's __dict__) but run in
        # their own threads on their own parameters.
        self._active: dict[int, list] = {}  # id(module) -> [depth, saved _flat_weights]
        self._frames: dict[int, list[tuple[Any, list[nn.Module]]]] = {}
        self._members: tuple[int, list[nn.Module]] | None = None
        # The same under torch.compile (see traced_hooks): shadowed names, owner frames.
        self._traced_shadows: list = []
        self._traced_frames: list = []
        # The owner whose cached region list holds this module (see forget_regions).
        self.region_owner: ModuleAmp | None = None

    @property
    def functions(self) -> FunctionLists | None:
        """The function lists this owner applies to its forward (O1's root), or ``None``."""
        return self._functions

    @functions.setter
    def functions(self, lists: FunctionLists | None) -> None:
        # One mode object for the model's life: Dynamo can enter a mode made outside
        # the traced code, not one made inside it and kept in the hooks' state.
        self._functions = lists
        self._mode = None if lists is None else _FunctionCastMode(lists, self._cache)

    def attach(self, module: nn.Module) -> None:
        """Store this state on ``module`` and register its two hooks."""
        module.__dict__[ATTR] = self
        self.shadow_params = not isinstance(module, nn.modules.batchnorm._NormBase)
        # Prepended: later pre-hooks and the forward see the cast inputs and weights.
        module.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True)
        module.register_forward_hook(self.post_hook, always_call=True)

    # -- parameter shadowing -----------------------------------------------------------

    def _shadow(self, module: nn.Module) -> None:
        active = self._active.get(id(module))
        if active is not None:  # nested call: the casts are in place already
            active[0] += 1
            return
        active = self._active[id(module)] = [1, None]
        if not self.shadow_params:
            return
        dtype, attrs = self.compute_dtype, module.__dict__
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                attrs[name] = self._cache.get(name, param, dtype)
        if "_flat_weights" in attrs and hasattr(module, "_flat_weights_names"):
            # nn.RNN/LSTM/GRU read a list of their weights, not the attributes.
            saved = active[1] = attrs["_flat_weights"]
            attrs["_flat_weights"] = [
                attrs.get(name, weight) for name, weight in zip(module._flat_weights_names, saved)
            ]

    def _unshadow(self, module: nn.Module) -> None:
        active = self._active.get(id(module))
        if active is None:
            return  # our pre-hook never ran (an earlier hook raised)
        active[0] -= 1
        if active[0]:
            return
        del self._active[id(module)]
        if not self.shadow_params:
            return
        attrs = module.__dict__
        for name in module._parameters:
            attrs.pop(name, None)
        if active[1] is not None:
            attrs["_flat_weights"] = active[1]

    def members(self, owner: nn.Module) -> list[nn.Module]:
        """The owner's region, recomputed only after a policy changed in it."""
        cached = self._members
        if cached is None or cached[0] != id(owner):
            cached = self._members = (id(owner), region_members(owner))
            for member in cached[1][1:]:
                get_state(member).region_owner = self
        return cached[1]

    # -- hooks -------------------------------------------------------------------------

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if torch.compiler.is_compiling():
            return traced_hooks.pre_hook(
                self, module, args, kwargs, _region_stack(), get_state, region_members
            )
        dtype = self.compute_dtype
        new_args, new_kwargs = cast_floating((args, kwargs), dtype)  # one cast per tensor
        if self.policy is None:
            self._shadow(module)
        else:
            stack = _region_stack()
            if not stack:  # the outermost region opens a forward pass for the cast cache
                _local.pass_token = object()
            members = self.members(module)
            for member in members:
                get_state(member)._shadow(member)
            stack.append(dtype)
            mode = self._enter_functions()
            self._frames.setdefault(id(module), []).append((mode, members))
        if new_args is args and new_kwargs is kwargs:
            return None
        return new_args, new_kwargs

    def _enter_functions(self) -> _FunctionCastMode | None:
        """Enter the function-cast mode unless an outer region did (O1's root only)."""
        mode = self._mode
        if mode is None or _local.functions:
            return None
        _local.functions.append(self._functions)
        mode.__enter__()
        return mode

    def _exit_functions(self, mode: _FunctionCastMode | None) -> None:
        if mode is not None:
            _local.functions.pop()
            mode.__exit__(None, None, None)

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return traced_hooks.post_hook(self, module, output, _region_stack(), get_state)
        if self.policy is None:
            self._unshadow(module)
            return None
        frames = self._frames.get(id(module))
        if not frames:
            return None  # our pre-hook never ran (an earlier hook raised)
        mode, members = frames.pop()
        if not frames:
            del self._frames[id(module)]
        self._exit_functions(mode)
        stack = _region_stack()
        stack.pop()
        for member in members:
            get_state(member)._unshadow(member)
        if not stack:
            _local.pass_token = None
        policy = self.policy
        if output is None or (policy.output_dtype == policy.compute_dtype and self.level is None):
            # The output stays as computed: normally the compute dtype, but a nested
            # float32 layer's output stays float32 (a model's output is its
            # last layer's, Dense(2, dtype="float32") gives float32). A level's root
            # always casts: under O1 its last allow-listed layer hands back low precision.
            return None
        return cast_floating(output, policy.output_dtype)

    def __getstate__(self) -> dict[str, Any]:
        # Region lists and per-call frames refer to live modules; a copy rebuilds them.
        state = dict(self.__dict__)
        state.update(_members=None, _frames={}, _active={}, region_owner=None)
        state.update(_traced_shadows=[], _traced_frames=[])
        return state
