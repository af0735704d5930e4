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
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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

# Per-thread call state (like torch.autocast's): the stack of region dtypes being
# run, and the token of the forward pass that the cast cache is valid for.
_local = threading.local()


def _region_stack() -> list[torch.dtype]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _current_pass() -> object | None:
    return getattr(_local, "pass_token", None)


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
        lists = self.lists
        target = (
            lists.low_dtype if func in lists.low else torch.float32 if func in lists.high else None
        )
        stack = _region_stack()
        if target is None or not stack or "out" in kwargs:
            return func(*args, **kwargs)
        if lists.keep_outputs:
            if _needs_cast((args, kwargs), target):  # usually not: the region cast them
                args, kwargs = self.cache.cast_args((args, kwargs), target)
            return func(*args, **kwargs)
        region = stack[-1]
        if region == target:
            return func(*args, **kwargs)
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


class _CastCache:
    """Casts of parameters, reused until the parameter changes (see module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple] = {}

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
        return cast

    def cast_args(self, tree: Any, dtype: torch.dtype) -> Any:
        """``cast_floating(tree, dtype)``, with parameters taken from the cache."""
        if isinstance(tree, nn.Parameter) and tree.is_floating_point() and tree.dtype != dtype:
            return self.get(id(tree), tree, dtype)
        if isinstance(tree, (list, tuple, dict)):
            if isinstance(tree, dict):
                items = {k: self.cast_args(v, dtype) for k, v in tree.items()}
                return items if any(items[k] is not v for k, v in tree.items()) else tree
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
        self._entries = {}


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
        self.functions: FunctionLists | None = None
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
        # The owner whose cached region list holds this module (see forget_regions).
        self.region_owner: ModuleAmp | None = None

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
            mode = None
            if (
                # Dynamo cannot trace a mode entered inside a hook; compiled models
                # get the module lists only.
                not torch.compiler.is_compiling()
                and self.functions is not None
                and not getattr(_local, "mode_active", False)
            ):
                mode = _FunctionCastMode(self.functions, self._cache)
                mode.__enter__()
                _local.mode_active = True
            self._frames.setdefault(id(module), []).append((mode, members))
        if new_args is args and new_kwargs is kwargs:
            return None
        return new_args, new_kwargs

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.policy is None:
            self._unshadow(module)
            return None
        frames = self._frames.get(id(module))
        if not frames:
            return None  # our pre-hook never ran (an earlier hook raised)
        mode, members = frames.pop()
        if not frames:
            del self._frames[id(module)]
        if mode is not None:
            _local.mode_active = False
            mode.__exit__(None, None, None)
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
        return state
