"""Per-module precision: give one module (and its submodules) a :class:`~mixprec.Policy`.

``set_policy(module, policy)`` gives one layer its own precision: the module's
parameters are stored in ``policy.param_dtype``, its floating inputs are cast to
``policy.compute_dtype`` on entry (a forward pre-hook), its parameters are cast to the
compute dtype on the fly when the two differ (one cached cast per forward pass), and
its floating outputs are cast to ``policy.output_dtype`` when that differs from the
compute dtype (otherwise they stay as computed: a float32 last layer gives a float32
output). The policy covers the module's whole subtree except submodules that have a
policy of their own, so one layer can stay float32 inside a float16 model::

    set_policy(model, "mixed_float16")         # parameters fp32, compute fp16
    set_policy(model.head, "float32")          # the head computes in fp32

Inside a region every module holding parameters casts its own inputs to the
region's compute dtype, so the float32 output of the head above can feed another
float16 layer without a dtype error. Functional code between modules sees whatever
dtype arrives: ``a + b`` of a float16 and a float32 tensor promotes to float32, as in
plain PyTorch. The hooks that do the casting are :mod:`mixprec.amp._cast_hooks`.

Set per-module policies before ``amp.initialize``; ``initialize`` keeps them and
fills in the rest of the model by its level.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
>>> set_policy(net, "mixed_bfloat16")
>>> to_float(net[1], torch.float32)
>>> net(torch.randn(3, 4)).dtype, net[0].weight.dtype
(torch.float32, torch.float32)
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._checks import check_instance
from mixprec.amp._cast_hooks import ModuleAmp, forget_regions, get_state
from mixprec.amp._claim import claim_tree
from mixprec.policy import Policy, PolicyLike, global_policy


def check_module(name: str, module: Any) -> nn.Module:
    """Raise ``TypeError`` unless ``module`` is an ``nn.Module``."""
    return check_instance(name, module, nn.Module, "a torch.nn.Module")


def walk_region(owner: nn.Module, owners: set[int]) -> Iterator[nn.Module]:
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
    never makes a round trip through bfloat16). The regions of the owners in ``bare``
    (O1's root: ``torch.autocast`` decides there) cast nothing of their own: each of
    their modules is an *entry* instead, whose call opens the owner's region when
    none is open (a submodule called directly runs under autocast as through the root).
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
        state.entry = None
    owners = {id(module) for module in _all_owners(plan)}
    for owner, policy, _ in plan:
        owner_state = get_state(owner) if id(owner) in bare_ids else None
        for module in walk_region(owner, owners - {id(owner)}):
            _cast_storage(module, policy.param_dtype)
            if module is owner:
                continue
            state = get_state(module)
            if state is None and (owner_state is not None or _has_floating_params(module)):
                state = ModuleAmp(policy.compute_dtype)
                state.attach(module)
            if state is not None:
                state.compute_dtype = policy.compute_dtype
                state.entry = owner_state


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

