"""The cast hooks' path under ``torch.compile``: the same casts, in code Dynamo traces.

While Dynamo traces a model (``torch.compiler.is_compiling()``), the hooks of
:mod:`mixprec.amp._cast_hooks` hand over to the functions here, which compute the
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
``_AutocastMode`` there (see the cast hooks).

>>> import torch
>>> x = torch.ones(2)
>>> q, k, n = cast_tree((x, x, 3), torch.bfloat16)
>>> q.dtype, q is k, n
(torch.bfloat16, True, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

#: Name of the per-module amp state in ``module.__dict__`` (``ModuleAmp``).
ATTR = "_mixprec_amp"


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
    state: Any, module: nn.Module, args: tuple, kwargs: dict, local: Any, members, device_type
):
    """``ModuleAmp.pre_hook`` under ``torch.compile`` (``state`` is the module's ``ModuleAmp``,
    ``local`` the thread's call state, ``members`` what ``region_members`` computes,
    ``device_type`` the device type a module computes on).

    The region is walked afresh, not read from the owner's cached list: a check of
    that cache would be a guard that fails once the first call has filled it.
    """
    owner = state
    if state.entry is not None and state.policy is None:  # a module of O1's region
        # Inside the region already, or in a torch.autocast region (as the eager hook).
        if local.autocast or torch.is_autocast_enabled(device_type(module, args, kwargs)):
            if state._traced_frames:
                state._traced_frames.append(None)
            return None
        owner = state.entry
    if (
        state._batchnorm
        and owner.policy is not None
        and owner._takes_low_input(module, args, kwargs)
    ):
        new_args, new_kwargs = args, kwargs
    else:
        new_args, new_kwargs = cast_tree((args, kwargs), owner.compute_dtype)
    if owner.policy is None:
        if state.shadow_params:
            shadow(module, state.compute_dtype, state._traced_shadows)
        return new_args, new_kwargs
    region_members = members(module) if owner is state else []
    for member in region_members:
        member_state = member.__dict__[ATTR]
        if member_state.shadow_params:
            shadow(member, member_state.compute_dtype, member_state._traced_shadows)
    region = owner._enter_autocast(module, new_args, new_kwargs)
    local.stack.append(owner.compute_dtype)
    state._traced_frames.append((owner, owner._enter_functions(), region_members, region))
    return new_args, new_kwargs


def traced_post_hook(state: Any, module: nn.Module, output: Any, local: Any) -> Any:
    """``ModuleAmp.post_hook`` under ``torch.compile``: undo :func:`traced_pre_hook`, cast the output."""
    if state.policy is None and state.entry is None:
        if state.shadow_params:
            unshadow(module, state._traced_shadows)
        return None
    if not state._traced_frames:
        return None  # the pre-hook did nothing (inside O1's region) or never ran
    frame = state._traced_frames.pop()
    if frame is None:
        return None  # a call inside this module's own call
    owner, mode, members, region = frame
    owner._exit_functions(mode)
    owner._exit_autocast(region)
    local.stack.pop()
    for member in members:
        member_state = member.__dict__[ATTR]
        if member_state.shadow_params:
            unshadow(member, member_state._traced_shadows)
    policy = owner.policy
    if output is None or (policy.output_dtype == policy.compute_dtype and owner.level is None):
        return None  # the output stays as computed (as ModuleAmp.post_hook)
    return cast_tree(output, policy.output_dtype)
