"""How a module computes in its dtype: per-module policies, the cast hooks, their cache.

Per-module precision: give one module (and its submodules) a :class:`~mixprec.Policy`.

``set_policy(module, policy)`` gives one layer its own precision: the module's parameters are stored in
``policy.param_dtype``, its floating inputs are cast to ``policy.compute_dtype`` on
entry (a forward pre-hook), its parameters are cast to the compute dtype on the fly
when the two differ (one cached cast per optimizer step), and its floating outputs
are cast to ``policy.output_dtype`` when that differs from the compute dtype
(otherwise they stay as computed: a float32 last layer gives a float32 output). The policy covers the module's whole subtree
except submodules that have a policy of their own, so one layer can stay float32
inside a float16 model::

    set_policy(model, "mixed_float16")         # parameters fp32, compute fp16
    set_policy(model.head, "float32")          # the head computes in fp32

Inside a region every module holding parameters casts its own inputs to the
region's compute dtype, so the float32 output of the head above can feed another
float16 layer without a dtype error. Functional code
between modules sees whatever dtype arrives: ``a + b`` of a float16 and a float32
tensor promotes to float32, as in plain PyTorch.

Set per-module policies before ``amp.initialize``; ``initialize`` keeps them and
fills in the rest of the model by its level.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
>>> set_policy(net, "mixed_bfloat16")
>>> to_float(net[1], torch.float32)
>>> net(torch.randn(3, 4)).dtype, net[0].weight.dtype
(torch.float32, torch.float32)

Record which mixed-precision API a model went through, so two are never mixed.
------------------------------------------------------------------------------

The seed systems allow only one of their two mixed-precision APIs on a model
(the per-module policy / amp-level API, or the graph rewrite): applying both
makes casts fight each other. Each entry point calls :func:`claim_model` first.

>>> import torch
>>> net = torch.nn.Linear(2, 2)
>>> claim_model(net, "amp")
>>> claim_model(net, "rewrite")
Traceback (most recent call last):
...
ValueError: model already uses the mixprec 'amp' API; ...

The forward hooks that make a module compute in its dtype, and their cast cache.
--------------------------------------------------------------------------------

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
        O1's root: enter torch.autocast; another owner inside it: autocast off
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
mode. The pass's end empties every cache it filled, so no cast outlives the pass
(no memory held between steps; the casts autograd saved for the backward are
autograd's), an optimizer step (fused ones update without a version bump) or an
edit through ``param.data`` between two forwards is always seen, and no
process-wide hook or counter is needed: the state is the model's.

O1 with the default lists needs none of this: its root is the only module with
hooks, and they enter and leave ``torch.autocast`` around the forward (on the
device type of the first tensor argument, else of the model's parameters), so
the dispatcher casts as autocast does, with autocast's own cache. An owner
inside that region (a policy the user set) turns autocast off in its own region,
whose casts then decide. Under Dynamo, which would lose process-wide autocast
state at a graph break between the two hooks, a torch function mode carries it
instead and re-enters autocast around each torch call (``_AutocastMode``).

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
the traced hooks below: the same casts, without the cache and the identity
tests that would break the graph.

The cast cache of the amp hooks, and the per-thread call state it is valid for.
-------------------------------------------------------------------------------

One cast per parameter per forward pass of the model, not per call (the lifetime of
``torch.autocast``'s cache). The outermost region entered on a thread opens a pass
(a fresh token); an entry is reused only within the pass that made it, while the
parameter's ``_version`` and storage are unchanged and while it suits the grad mode.
The pass's end (the outermost region's post-hook) empties the caches that the
pass filled, so nothing outlives it: no cast is kept between steps, and an
optimizer step or an edit through ``param.data`` between two forwards is always
seen. Under ``torch.compile`` the cache is not used (see the traced hooks below).

>>> import torch
>>> cache, w = _CastCache(), torch.nn.Parameter(torch.ones(2))
>>> _local.pass_token = object()
>>> cache.get("w", w, torch.bfloat16) is cache.get("w", w, torch.bfloat16)
True
>>> _local.pass_token = None; _end_pass(); cache._entries
{}

The cast hooks' path under ``torch.compile``: the same casts, in code Dynamo traces.
------------------------------------------------------------------------------------

While Dynamo traces a model (``torch.compiler.is_compiling()``), the hooks of
the cast hooks above hand over to the functions here, which compute the
same thing without what breaks a graph or forces a recompile:

* no identity tests on containers (``new is old``) and no ``id()`` keys: argument
  trees are always rebuilt (free in a graph), and a tensor passed twice is still
  cast once and stays one object (self-attention's ``query is key``);
* no cast cache: a parameter is cast where it is read, and the compiled graph is
  the cache (common-subexpression elimination merges repeated casts, and the
  cache's ``data_ptr``/``_version`` checks have no meaning on traced tensors);
* no thread-local pass token; the per-call state is a list on the module's state,
  which Dynamo records as a side effect like any other Python mutation.

Function lists (``torch.matmul`` and friends in lists of the user's own) are
applied by the same ``TorchFunctionMode`` as in eager mode, entered in the root's
pre-hook and left in its post-hook; its ``__torch_function__`` also takes the traced
path, so a compiled model computes what the eager one does. O1's autocast rides on
``_AutocastMode`` there (see above).

>>> import torch
>>> x = torch.ones(2)
>>> q, k, n = cast_tree((x, x, 3), torch.bfloat16)
>>> q.dtype, q is k, n
(torch.bfloat16, True, 3)
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec._checks import check_instance
from mixprec.policy import Policy, PolicyLike, _nothing_to_cast, cast_floating, global_policy

__all__ = [
    "set_policy",
    "to_float",
    "get_policy",
    "compute_dtype",
    "check_module",
    "claim_tree",
    "apply_policies",
    "ATTR",
    "ModuleAmp",
    "FunctionLists",
    "get_state",
    "state_of",
    "forget_regions",
    "region_members",
    "cast_tree",
    "shadow",
    "unshadow",
    "traced_pre_hook",
    "traced_post_hook",
]

def check_module(name: str, module: Any) -> nn.Module:
    """Raise ``TypeError`` unless ``module`` is an ``nn.Module``."""
    return check_instance(name, module, nn.Module, "a torch.nn.Module")


def claim_tree(model: nn.Module) -> None:
    """Mark ``model`` and its submodules as using the amp API.

    Raises ``ValueError`` (changing nothing) if any of them went through the graph
    rewrite: only one mixed-precision API can be used on a model.
    """
    modules = list(model.modules())
    for module in modules:
        if model_api(module) not in (None, "amp"):
            claim_model(module, "amp")  # raises, naming the other API
    for module in modules:
        claim_model(module, "amp")


def _walk_region(owner: nn.Module, owners: set[int]) -> Iterator[nn.Module]:
    """``owner`` and its subtree, not descending into other owners."""
    seen, stack = set(), [owner]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        stack.extend(
            child
            for child in module._modules.values()
            if child is not None and id(child) not in owners
        )


def _cast_storage(module: nn.Module, dtype: torch.dtype) -> None:
    """Store ``module``'s own floating parameters and buffers in ``dtype``, in place.

    ``param.data`` is replaced, so each Parameter keeps its identity: optimizers and
    anything else holding it see the new dtype.
    """
    for param in module._parameters.values():
        if param is not None and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
    for name, buf in module._buffers.items():
        if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
            module._buffers[name] = buf.to(dtype)


def _has_floating_params(module: nn.Module) -> bool:
    return any(p is not None and p.is_floating_point() for p in module._parameters.values())


def apply_policies(
    plan: Sequence[tuple[nn.Module, Policy, bool]], bare: Collection[nn.Module] = ()
) -> None:
    """Make each ``(module, policy, user)`` in ``plan`` an owner and configure its region.

    All owners are marked first, so no region casts a parameter that a nested
    owner stores in another dtype (a float32 BatchNorm inside a bfloat16 model
    never makes a round trip through bfloat16). The owners in ``bare`` get no hooks
    on the members of their regions (O1's root: ``torch.autocast`` decides there).
    """
    bare_ids = {id(module) for module in bare}
    for module, _, _ in plan:
        forget_regions(module)
    for module, policy, user in plan:
        state = get_state(module)
        if state is None:
            state = ModuleAmp(policy.compute_dtype)
            state.attach(module)
        state.compute_dtype, state.policy, state.user_policy = (
            policy.compute_dtype,
            policy,
            user,
        )
    owners = {id(module) for module in _all_owners(plan)}
    for owner, policy, _ in plan:
        for module in _walk_region(owner, owners - {id(owner)}):
            _cast_storage(module, policy.param_dtype)
            if module is owner or id(owner) in bare_ids:
                continue
            state = get_state(module)
            if state is None and _has_floating_params(module):
                state = ModuleAmp(policy.compute_dtype)
                state.attach(module)
            if state is not None:
                state.compute_dtype = policy.compute_dtype


def _all_owners(plan: Sequence[tuple[nn.Module, Policy, bool]]) -> list[nn.Module]:
    """Every owner under the planned ones (planned, and those set earlier)."""
    owners: list[nn.Module] = []
    for root, _, _ in plan:
        owners.extend(m for m in root.modules() if (s := get_state(m)) and s.policy is not None)
    return owners


def set_policy(module: nn.Module, policy: PolicyLike | None = None) -> None:
    """Run ``module`` (and submodules without a policy of their own) under ``policy``.

    ``policy``: a :class:`~mixprec.Policy`, a policy name (``"mixed_float16"``,
    ``"p=f32,c=bf16,o=f32"``), a ``torch.dtype`` or ``None`` for
    :func:`mixprec.global_policy`. Calling it again replaces the module's policy.

    Algorithm::

        owner(module) <- policy
        for m in module's subtree, stopping at other owners:
            m's own parameters and floating buffers <- stored in policy.param_dtype
            m holds parameters: pre-hook casts its floating inputs to compute dtype
        per call: see ModuleAmp

    Raises ``TypeError``/``ValueError`` for a bad module or policy and ``ValueError``
    if the model went through the graph rewrite; then nothing changes.

    >>> import torch
    >>> lin = torch.nn.Linear(3, 3)
    >>> set_policy(lin, "p=f32,c=bf16,o=f32")
    >>> lin(torch.ones(1, 3)).dtype, lin.weight.dtype
    (torch.float32, torch.float32)
    """
    check_module("module", module)
    policy = global_policy() if policy is None else _as_policy(policy)
    claim_tree(module)
    apply_policies([(module, policy, True)])


def to_float(module: nn.Module, dtype: torch.dtype | str) -> None:
    """Compute ``module`` in ``dtype`` with float32 parameters.

    The same as ``set_policy(module, Policy(param_dtype=torch.float32,
    compute_dtype=dtype, output_dtype=dtype))``: inputs are cast to ``dtype`` on
    entry, parameters stay float32 and are cast on the fly, and outputs stay in
    ``dtype``. ``to_float(layer, torch.float32)`` keeps one layer float32 inside a
    low-precision model.

    >>> import torch
    >>> conv = torch.nn.Conv2d(1, 2, 3)
    >>> to_float(conv, torch.bfloat16)
    >>> conv(torch.ones(1, 1, 5, 5)).dtype, conv.weight.dtype
    (torch.bfloat16, torch.float32)
    """
    check_module("module", module)
    try:
        policy = Policy(param_dtype=torch.float32, compute_dtype=dtype, output_dtype=dtype)
    except (TypeError, ValueError) as err:
        raise type(err)(f"to_float: dtype {dtype!r} rejected: {err}") from None
    claim_tree(module)
    apply_policies([(module, policy, True)])


def get_policy(module: nn.Module) -> Policy | None:
    """The policy given to ``module`` itself (``None`` if it only inherits one or has none).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> set_policy(net, "mixed_float16")
    >>> str(get_policy(net)), get_policy(net[0])
    ('mixed_float16', None)
    """
    check_module("module", module)
    state = get_state(module)
    return None if state is None else state.policy


def compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype ``module`` casts its inputs to (``None`` when no policy covers it)."""
    state = get_state(module)
    return None if state is None else state.compute_dtype


def _as_policy(policy: Any) -> Policy:
    if not isinstance(policy, (Policy, str, torch.dtype)):
        raise TypeError(
            f"policy must be a mixprec.Policy, a policy name or a torch.dtype, got "
            f"{type(policy).__name__} {policy!r}; e.g. policy='mixed_bfloat16'"
        )
    return Policy(policy)


# --------------------------------------------------------------------------------------

_ATTR = "_mixprec_api"

_HOW_TO_FIX = {
    "amp": "the model already went through amp.initialize / to_float / a policy",
    "rewrite": "the model is already a graph-rewritten module",
}


def model_api(model: torch.nn.Module) -> str | None:
    """Return the mixed-precision API name recorded on ``model`` (or ``None``)."""
    return getattr(model, _ATTR, None)


def claim_model(model: torch.nn.Module, api: str) -> None:
    """Mark ``model`` as using ``api``; raise ``ValueError`` if another API (or the
    rewrite, twice) already claimed it. Claiming ``"amp"`` twice is allowed: per-module
    overrides can be layered."""
    current = model_api(model)
    if current is not None and (current != api or api == "rewrite"):
        raise ValueError(
            f"model already uses the mixprec {current!r} API; "
            f"{_HOW_TO_FIX.get(current, '')}. Only one mixed-precision API can be used on a "
            f"model: start again from the float32 model to use {api!r}."
        )
    object.__setattr__(model, _ATTR, api)


# --------------------------------------------------------------------------------------

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


def state_of(module: nn.Module) -> ModuleAmp:
    """The amp state of a ``module`` known to have one (a region member, a claimed
    root); ``KeyError`` if it has none."""
    return module.__dict__[ATTR]


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
        # One lookup per intercepted call: the mode sees every torch function the
        # forward calls, and all but the listed ones must cost as little as possible.
        self.targets: dict[Any, torch.dtype] = dict.fromkeys(high, torch.float32)
        self.targets.update(dict.fromkeys(low, low_dtype))


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
        target = lists.targets.get(func)
        if target is None:  # not listed: straight through, nothing else looked at
            return func(*args, **kwargs)
        stack = _region_stack()
        if not stack or "out" in kwargs:
            return func(*args, **kwargs)
        if lists.keep_outputs:
            if torch.compiler.is_compiling():
                args, kwargs = cast_tree((args, kwargs), target)
            elif not _nothing_to_cast((args, kwargs), target):  # usually: the region cast them
                args, kwargs = self.cache.cast_args((args, kwargs), target)
            return func(*args, **kwargs)
        region = stack[-1]
        if region == target:
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():  # the graph is the cache (see traced_hooks)
            args, kwargs = cast_tree((args, kwargs), target)
            return cast_tree(func(*args, **kwargs), region)
        args, kwargs = self.cache.cast_args((args, kwargs), target)
        return cast_floating(func(*args, **kwargs), region)


class _AutocastMode(TorchFunctionMode):
    """``torch.autocast`` for code Dynamo traces: each torch function runs inside an
    autocast region of its own, as the innermost O1 entry on the thread says.

    Autocast is process state that a graph break would lose if the root's pre-hook
    set it in one compiled frame and the forward ran on in the next; a function mode
    is kept across graph breaks, and each call re-enters autocast inside it, so the
    dispatcher sees what one ``with torch.autocast(...)`` around the forward gives.
    Only used while Dynamo traces: eager O1 enters ``torch.autocast`` itself.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entries = _local.autocast
        if not entries:
            return func(*args, **kwargs)
        device, dtype, enabled, _ = entries[-1]
        if torch.compiler.is_compiling():  # traced: the graph records the region
            with torch.autocast(device, dtype, enabled=enabled):
                return func(*args, **kwargs)
        # Run, not traced: the compiled graphs' own wrapper code (hundreds of calls a
        # step) and any code between graphs. Autocast's state is set directly: building
        # a torch.autocast checks the device and the dtype on every call, tens of
        # microseconds each on a CUDA host, which left the GPU idle half the step.
        was_enabled, was_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        if was_enabled == enabled and (not enabled or was_dtype == dtype):
            return func(*args, **kwargs)
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
        torch.autocast_increment_nesting()
        try:
            return func(*args, **kwargs)
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled(device, was_enabled)
            torch.set_autocast_dtype(device, was_dtype)


#: One mode object for the process: Dynamo enters a mode made outside the traced code.
_AUTOCAST_MODE = _AutocastMode()
#: What ``_enter_autocast`` returns for an entry that only pushed onto the stack.
_NESTED = object()


def _device_type(module: nn.Module, args: tuple, kwargs: dict) -> str:
    """The device type ``module`` computes on: its first tensor argument's, else its
    first parameter's or buffer's, else the CPU."""
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device.type
    return "cpu"


def _exit_autocast(region: Any) -> None:
    """Leave what :meth:`ModuleAmp._enter_autocast` entered (``None``: nothing)."""
    if region is None:
        return
    _local.autocast.pop()
    if region is not _NESTED:
        region.__exit__(None, None, None)


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
        # O1's root with the default lists: its forward runs under torch.autocast in
        # this dtype (on the device its inputs are on).
        self.autocast: torch.dtype | None = None
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
        self._frames: dict[int, list[tuple[Any, list[nn.Module], Any]]] = {}
        self._members: tuple[int, list[nn.Module]] | None = None
        # The same under torch.compile (see traced_hooks): shadowed names, owner frames.
        self._traced_shadows: list = []
        self._traced_frames: list = []
        # The owner whose cached region list holds this module (see forget_regions).
        self.region_owner: ModuleAmp | None = None

    @property
    def functions(self) -> FunctionLists | None:
        """The function lists this owner applies to its forward (the root of a level given
        lists naming functions), or ``None``."""
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
        if not self.shadow_params:  # kept as stored: nothing to do, nothing to undo
            return
        dtype, attrs = self.compute_dtype, module.__dict__
        stale = [
            (name, param)
            for name, param in module._parameters.items()
            if param is not None and param.dtype != dtype and param.is_floating_point()
        ]
        if not stale:
            # Nothing to shadow (the weights are stored in the compute dtype, as at
            # O2/O3): no bookkeeping either, and _unshadow finds none to undo.
            return
        active = self._active[id(module)] = [1, None]
        for name, param in stale:
            attrs[name] = self._cache.get(name, param, dtype)
        if "_flat_weights" in attrs and hasattr(module, "_flat_weights_names"):
            # nn.RNN/LSTM/GRU read a list of their weights, not the attributes.
            saved = active[1] = attrs["_flat_weights"]
            names = cast(nn.RNNBase, module)._flat_weights_names
            attrs["_flat_weights"] = [attrs.get(name, weight) for name, weight in zip(names, saved)]

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
                state_of(member).region_owner = self
        return cached[1]

    # -- hooks -------------------------------------------------------------------------

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if torch.compiler.is_compiling():
            return traced_pre_hook(
                self, module, args, kwargs, _region_stack(), get_state, region_members
            )
        dtype = self.compute_dtype
        if self._takes_low_input(module, args, kwargs):
            new_args, new_kwargs = args, kwargs
        else:
            new_args, new_kwargs = cast_floating((args, kwargs), dtype)  # one cast per tensor
        if self.policy is None:
            self._shadow(module)
        else:
            region = self._enter_autocast(module, new_args, new_kwargs)  # may raise: first
            stack = _region_stack()
            if not stack:  # the outermost region opens a forward pass for the cast cache
                _local.pass_token = object()
            members = self.members(module)
            for member in members:
                state_of(member)._shadow(member)
            stack.append(dtype)
            mode = self._enter_functions()
            self._frames.setdefault(id(module), []).append((mode, members, region))
        if new_args is args and new_kwargs is kwargs:
            return None
        return new_args, new_kwargs

    def _takes_low_input(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether a float32 BatchNorm takes its low-precision input as it comes: its
        CPU and CUDA kernels compute in float32 from bfloat16 or float16 input and
        float32 weights and statistics, so the cast up on entry and the cast down to
        an output in the input's dtype (O2's normalisation layers) are two passes over
        the activation forward and two backward that change nothing but the rounding
        order (torch.autocast and Apex's O2 pass it through too). A float32 output
        (O1's ``keep_batchnorm_fp32``), other inputs or devices, and ``SyncBatchNorm``
        (its own kernels) keep the casts."""
        policy = self.policy
        if (
            policy is None
            or kwargs
            or len(args) != 1
            or self.compute_dtype != torch.float32
            or not isinstance(module, nn.modules.batchnorm._BatchNorm)
            or isinstance(module, nn.SyncBatchNorm)
        ):
            return False
        x = args[0]
        return (
            isinstance(x, torch.Tensor)
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == policy.output_dtype
            and x.device.type in ("cpu", "cuda")
            and all(
                t is None or t.dtype == torch.float32
                for t in (module.weight, module.bias, module.running_mean, module.running_var)
            )
        )

    def _enter_autocast(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Enter ``torch.autocast`` for O1's root; leave it off in the region of any
        other owner inside one (a policy of the user's, a float32 normalisation layer:
        the region's own casts decide there). ``None`` when neither applies."""
        entries = _local.autocast
        if self.autocast is not None:
            device, dtype, enabled = _device_type(module, args, kwargs), self.autocast, True
        elif entries and entries[-1][2]:
            device, dtype, enabled = entries[-1][0], entries[-1][1], False
        else:
            return None
        if torch.compiler.is_dynamo_compiling():
            via_mode = not any(entry[3] for entry in entries)
            entries.append((device, dtype, enabled, via_mode))
            if not via_mode:
                return _NESTED
            _AUTOCAST_MODE.__enter__()
            return _AUTOCAST_MODE
        if not torch.amp.is_autocast_available(device):
            raise ValueError(
                f"level O1 runs the model under torch.autocast, which is not available on "
                f"device type {device!r} (where the model's inputs are); use level O2 or O3, "
                "or pass white_list/black_list to O1 (its casts of its own)"
            )
        region = torch.autocast(device, dtype, enabled=enabled)
        region.__enter__()
        entries.append((device, dtype, enabled, False))
        return region

    def _enter_functions(self) -> _FunctionCastMode | None:
        """Enter the function-cast mode unless an outer region did (roots with lists only)."""
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
            return traced_post_hook(self, module, output, _region_stack(), get_state)
        if self.policy is None:
            self._unshadow(module)
            return None
        frames = self._frames.get(id(module))
        if not frames:
            return None  # our pre-hook never ran (an earlier hook raised)
        mode, members, region = frames.pop()
        if not frames:
            del self._frames[id(module)]
        self._exit_functions(mode)
        _exit_autocast(region)
        stack = _region_stack()
        stack.pop()
        for member in members:
            state_of(member)._unshadow(member)
        if not stack:  # the forward pass ends: its casts go (autocast's cache does too)
            _local.pass_token = None
            _end_pass()
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


# --------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------

def cast_tree(tree: Any, dtype: torch.dtype, seen: list | None = None) -> Any:
    """Floating tensors in ``tree`` cast to ``dtype``; containers rebuilt (see module)."""
    if seen is None:
        seen = []
    if isinstance(tree, torch.Tensor):
        if not tree.is_floating_point() or tree.dtype == dtype:
            return tree
        for old, new in seen:
            if old is tree:
                return new
        cast = tree.to(dtype)
        seen.append((tree, cast))
        return cast
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*[cast_tree(item, dtype, seen) for item in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)([cast_tree(item, dtype, seen) for item in tree])
    if isinstance(tree, Mapping):
        values = {key: cast_tree(value, dtype, seen) for key, value in tree.items()}
        return values if type(tree) is dict else _same_mapping(tree, values)
    return tree


def _same_mapping(tree: Mapping, values: dict) -> Any:
    try:  # the tree's own mapping type (the ABC's signature says nothing of it)
        return cast(Any, type(tree))(values)
    except TypeError:  # a mapping whose constructor takes something else: the data is kept
        return values


def shadow(module: nn.Module, dtype: torch.dtype, frames: list) -> None:
    """Put casts of ``module``'s parameters in its ``__dict__`` (as ``_shadow`` does).

    Names already shadowed (a nested call of the same module) are left alone; what
    was set is pushed on ``frames`` for :func:`unshadow`.
    """
    attrs, names = module.__dict__, []
    for name, param in module._parameters.items():
        if (
            param is not None
            and name not in attrs
            and param.is_floating_point()
            and param.dtype != dtype
        ):
            attrs[name] = param.to(dtype)
            names.append(name)
    flat = None
    if names and "_flat_weights" in attrs and hasattr(module, "_flat_weights_names"):
        # nn.RNN/LSTM/GRU read a list of their weights, not the attributes.
        flat = attrs["_flat_weights"]
        weight_names = cast(nn.RNNBase, module)._flat_weights_names
        attrs["_flat_weights"] = [
            attrs.get(name, weight) for name, weight in zip(weight_names, flat)
        ]
    frames.append((names, flat))


def unshadow(module: nn.Module, frames: list) -> None:
    """Undo the latest :func:`shadow` of ``module``."""
    if not frames:
        return  # the pre-hook never ran (an earlier hook raised)
    names, flat = frames.pop()
    attrs = module.__dict__
    for name in names:
        attrs.pop(name, None)
    if flat is not None:
        attrs["_flat_weights"] = flat


def traced_pre_hook(
    state: Any, module: nn.Module, args: tuple, kwargs: dict, stack: list, get_state, members
):
    """``ModuleAmp.pre_hook`` under ``torch.compile`` (``state`` is the module's ``ModuleAmp``,
    ``stack`` the thread's region stack, ``members`` what ``region_members`` computes).

    The region is walked afresh, not read from the owner's cached list: a check of
    that cache would be a guard that fails once the first call has filled it.
    """
    if state._takes_low_input(module, args, kwargs):  # as the eager hook
        new_args, new_kwargs = args, kwargs
    else:
        new_args, new_kwargs = cast_tree((args, kwargs), state.compute_dtype)
    if state.policy is None:
        if state.shadow_params:
            shadow(module, state.compute_dtype, state._traced_shadows)
        return new_args, new_kwargs
    members = members(module)
    for member in members:
        member_state = get_state(member)
        if member_state.shadow_params:
            shadow(member, member_state.compute_dtype, member_state._traced_shadows)
    region = state._enter_autocast(module, new_args, new_kwargs)
    stack.append(state.compute_dtype)
    state._traced_frames.append((state._enter_functions(), members, region))
    return new_args, new_kwargs


def traced_post_hook(state: Any, module: nn.Module, output: Any, stack: list, get_state) -> Any:
    """``ModuleAmp.post_hook`` under ``torch.compile``: undo :func:`pre_hook`, cast the output."""
    if state.policy is None:
        if state.shadow_params:
            unshadow(module, state._traced_shadows)
        return None
    if not state._traced_frames:
        return None  # the pre-hook never ran (an earlier hook raised)
    mode, members, region = state._traced_frames.pop()
    state._exit_functions(mode)
    _exit_autocast(region)
    stack.pop()
    for member in members:
        member_state = get_state(member)
        if member_state.shadow_params:
            unshadow(member, member_state._traced_shadows)
    policy = state.policy
    if output is None or (policy.output_dtype == policy.compute_dtype and state.level is None):
        return None  # the output stays as computed (as ModuleAmp.post_hook)
    return cast_tree(output, policy.output_dtype)
