"""The forward hooks that make a module compute in its dtype.

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

Casts of parameters are cached for one forward pass of the model
(:mod:`mixprec.amp._cast_cache`), so each is made once per pass, not once per call.

O1 with the default lists needs none of this: its root's hooks enter and leave
``torch.autocast`` around the forward (on the device type of the first tensor
argument, else of the model's parameters), so the dispatcher casts as autocast
does, with autocast's own cache. Every other module of the root's region is an
*entry*: its hooks do nothing while an O1 region (or any ``torch.autocast``) is
open on the thread, and otherwise open the root's region around the call, so a
submodule called directly (``model.encoder(x)``, a GAN's ``self.discriminator(x)``)
runs under autocast and hands back float32, as the root does::

    entry pre-hook: O1 region or torch.autocast open -> nothing
                    else: as the root's pre-hook (enter autocast, open the pass)
    entry post-hook: undo what its pre-hook did; output <- cast to float32

An owner inside that region (a policy the user set) turns autocast off in its own
region, whose casts then decide. Under Dynamo, which would lose process-wide
autocast state at a graph break between the two hooks, a torch function mode
carries it instead and re-enters autocast around each torch call (``_AutocastMode``).

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
:mod:`mixprec.amp._traced_hooks`: the same casts, without the cache and the identity
tests that would break the graph.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.amp._cast_cache import _CastCache, _end_pass, _local
from mixprec.amp._traced_hooks import ATTR, cast_tree, traced_post_hook, traced_pre_hook
from mixprec.policy import Policy, _nothing_to_cast, cast_floating


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
        if state is not None and state.entry is None:  # (O1's entries shadow nothing)
            members.append(module)
        stack.extend(module._modules.values())
    return members


class FunctionLists:
    """Torch functions to run in low precision / float32, whatever region they are in.

    ``keep_outputs`` (level O1): a listed function's outputs stay in the dtype it ran
    in, as under ``torch.autocast``; otherwise they go back to the region's dtype, but
    for the functions in ``float32_outputs`` (the loss functions of ``high``: a loss
    computed inside a low-precision forward stays float32).
    """

    def __init__(
        self,
        low: frozenset,
        high: frozenset,
        low_dtype: torch.dtype,
        *,
        keep_outputs: bool = False,
        float32_outputs: frozenset = frozenset(),
    ) -> None:
        self.low, self.high, self.low_dtype = low, high, low_dtype
        self.keep_outputs = keep_outputs
        self.float32_outputs = float32_outputs
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
    the call sees what it would have seen without amp; a listed loss function's
    output stays float32 (``FunctionLists.float32_outputs``). ``out=`` calls run as given.
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
        stack = _local.stack
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
        if torch.compiler.is_compiling():  # the graph is the cache (see _traced_hooks)
            args, kwargs = cast_tree((args, kwargs), target)
            out = func(*args, **kwargs)
            return out if func in lists.float32_outputs else cast_tree(out, region)
        args, kwargs = self.cache.cast_args((args, kwargs), target)
        out = func(*args, **kwargs)
        return out if func in lists.float32_outputs else cast_floating(out, region)


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


class ModuleAmp:
    """What one module computes in, and the hooks that make it so.

    ``policy`` is set on owners (modules given a policy of their own, by
    ``set_policy``, ``to_float`` or ``amp.initialize``); members of an owner's region
    have only ``compute_dtype``. ``user_policy`` tells a policy set by the user from
    one ``amp.initialize`` derived from a level; ``level`` is set on the model root
    that ``amp.initialize`` configured. ``entry`` is set on the modules of O1's
    region (the root's subtree up to other owners): the root's state, whose region a
    call of the module opens when no O1 region is open on the thread.
    """

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype
        self.policy: Policy | None = None
        self.user_policy = False
        self.level: str | None = None
        # O1's root with the default lists: its forward runs under torch.autocast in
        # this dtype (on the device its inputs are on).
        self.autocast: torch.dtype | None = None
        self.entry: ModuleAmp | None = None
        self._functions: FunctionLists | None = None
        self._mode: _FunctionCastMode | None = None
        # Modules whose running statistics are updated in place (BatchNorm,
        # InstanceNorm) keep their parameters as stored: their kernels take
        # low-precision input with float32 weights and statistics, while a cast
        # weight next to float32 statistics is rejected.
        self.shadow_params = True
        self._batchnorm = False  # may take its low-precision input as it comes
        self._cache = _CastCache()
        # Per-call bookkeeping is keyed by the module object: nn.DataParallel
        # replicas share this state (they copy the module's __dict__) but run in
        # their own threads on their own parameters.
        self._active: dict[int, list] = {}  # id(module) -> [depth, saved _flat_weights]
        # id(module) -> a frame per call in progress: (owner, mode, members, autocast
        # region), or None for an entry's call made inside its own call.
        self._frames: dict[int, list[Any]] = {}
        # The owner's region: its modules, each with its state.
        self._members: tuple[int, list[tuple[nn.Module, ModuleAmp]]] | None = None
        # The same under torch.compile (see _traced_hooks): shadowed names, owner frames.
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
        self._batchnorm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        # Prepended: later pre-hooks and the forward see the cast inputs and weights.
        module.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True)
        module.register_forward_hook(self.post_hook, always_call=True)

    def members(self, owner: nn.Module) -> list[tuple[nn.Module, ModuleAmp]]:
        """The owner's region with each member's state, recomputed only after a policy
        changed in it."""
        cached = self._members
        if cached is None or cached[0] != id(owner):
            pairs = [(m, cast(ModuleAmp, get_state(m))) for m in region_members(owner)]
            cached = self._members = (id(owner), pairs)
            for _, state in pairs[1:]:
                state.region_owner = self
        return cached[1]

    # -- hooks -------------------------------------------------------------------------
    #
    # The two hooks run at every call of every hooked module, so the usual path (O2's:
    # no autocast, no function lists, parameters stored in the compute dtype) calls no
    # helper of its own: the rarer steps are methods called only when they have work.

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if torch.compiler.is_compiling():
            return traced_pre_hook(self, module, args, kwargs, _local, region_members, _device_type)
        owner = self
        if self.entry is not None and self.policy is None:
            # Inside O1's region (or an island in it), or inside a torch.autocast region
            # of someone else's (a checkpointed block recomputed in the backward, which
            # torch.utils.checkpoint runs under the autocast state of the forward): the
            # module computes as it is, in that region.
            if _local.autocast or torch.is_autocast_enabled(_device_type(module, args, kwargs)):
                if self._frames and (frames := self._frames.get(id(module))) is not None:
                    frames.append(None)  # a call inside this module's own: pair its post-hook
                return None
            owner = self.entry  # the model is entered here: open O1's region as its root does
        dtype = owner.compute_dtype
        if (
            self._batchnorm
            and owner.policy is not None
            and owner._takes_low_input(module, args, kwargs)
        ):
            new_args, new_kwargs = args, kwargs
        else:
            new_args, new_kwargs = cast_floating((args, kwargs), dtype)  # one cast per tensor
        region: Any = None
        if owner.policy is None:  # a member of a region: its own parameters
            members: Any = ((module, self),)
        else:
            entries = _local.autocast
            if owner.autocast is not None or (entries and entries[-1][2]):
                region = owner._enter_autocast(module, new_args, new_kwargs)  # may raise: first
            if not _local.stack:  # the outermost region opens a forward pass for the cast cache
                _local.pass_token = object()
            if owner is not self:
                members = ()  # O1's region: autocast casts, nothing is shadowed
            elif (cached := self._members) is not None and cached[0] == id(module):
                members = cached[1]
            else:
                members = self.members(module)
        # Shadow each member's parameters whose dtype is not its compute dtype: the cast
        # (cached for the pass) goes in the module's __dict__, where attribute lookup
        # finds it before the Parameter in _parameters.
        for member, state in members:
            active = state._active.get(id(member))
            if active is not None:  # nested call: the casts are in place already
                active[0] += 1
                continue
            if not state.shadow_params:  # kept as stored: nothing to do, nothing to undo
                continue
            compute, stale = state.compute_dtype, None
            for name, param in member._parameters.items():
                if param is not None and param.dtype != compute and param.is_floating_point():
                    if stale is None:
                        stale = []
                    stale.append((name, param))
            if stale is None:
                # Nothing to shadow (the weights are stored in the compute dtype, as at
                # O2/O3): no bookkeeping either, and the post-hook finds none to undo.
                continue
            active = state._active[id(member)] = [1, None]
            attrs = member.__dict__
            for name, param in stale:
                attrs[name] = state._cache.get(name, param, compute)
            if "_flat_weights" in attrs and hasattr(member, "_flat_weights_names"):
                # nn.RNN/LSTM/GRU read a list of their weights, not the attributes.
                saved = active[1] = attrs["_flat_weights"]
                names = cast(nn.RNNBase, member)._flat_weights_names
                attrs["_flat_weights"] = [attrs.get(n, w) for n, w in zip(names, saved)]
        if owner.policy is not None:
            _local.stack.append(dtype)
            mode = owner._enter_functions() if owner._mode is not None else None
            self._frames.setdefault(id(module), []).append((owner, mode, members, region))
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

    @staticmethod
    def _exit_autocast(region: Any) -> None:
        """Leave what :meth:`_enter_autocast` entered (``None``: nothing)."""
        if region is None:
            return
        _local.autocast.pop()
        if region is not _NESTED:
            region.__exit__(None, None, None)

    def _enter_functions(self) -> _FunctionCastMode | None:
        """Enter the function-cast mode unless an outer region did (roots with lists only)."""
        mode = self._mode
        if mode is None or _local.functions:
            return None
        _local.functions.append(self._functions)
        mode.__enter__()
        return mode

    @staticmethod
    def _exit_functions(mode: _FunctionCastMode | None) -> None:
        if mode is not None:
            _local.functions.pop()
            mode.__exit__(None, None, None)

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return traced_post_hook(self, module, output, _local)
        owner: ModuleAmp | None = None
        if self.policy is None and self.entry is None:  # a member of a region
            members: Any = ((module, self),)
        else:
            frames = self._frames.get(id(module)) if self._frames else None
            if not frames:
                return None  # the pre-hook did nothing (inside O1's region) or never ran
            frame = frames.pop()
            if not frames:
                del self._frames[id(module)]
            if frame is None:
                return None  # a call inside this module's own call
            owner, mode, members, region = frame
            if mode is not None:
                self._exit_functions(mode)
            if region is not None:
                self._exit_autocast(region)
            _local.stack.pop()
        for member, state in members:  # undo the pre-hook's shadowing
            active = state._active.get(id(member))
            if active is None:
                continue  # nothing shadowed, or our pre-hook never ran (an earlier hook raised)
            active[0] -= 1
            if active[0]:
                continue
            del state._active[id(member)]
            attrs = member.__dict__
            for name in member._parameters:
                attrs.pop(name, None)
            if active[1] is not None:
                attrs["_flat_weights"] = active[1]
        if owner is None:
            return None
        if not _local.stack:  # the forward pass ends: its casts go (autocast's cache does too)
            _local.pass_token = None
            _end_pass()
        policy = cast(Policy, owner.policy)
        if output is None or (policy.output_dtype == policy.compute_dtype and owner.level is None):
            # The output stays as computed: normally the compute dtype, but a nested
            # float32 layer's output stays float32 (a model's output is its
            # last layer's, Dense(2, dtype="float32") gives float32). A level's root
            # (and O1's region entered through another module) always casts: under O1
            # its last allow-listed layer hands back low precision.
            return None
        return cast_floating(output, policy.output_dtype)

    def __getstate__(self) -> dict[str, Any]:
        # Region lists and per-call frames refer to live modules; a copy rebuilds them.
        state = dict(self.__dict__)
        state.update(_members=None, _frames={}, _active={}, region_owner=None)
        state.update(_traced_shadows=[], _traced_frames=[])
        return state
