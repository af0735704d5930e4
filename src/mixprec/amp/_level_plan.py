"""The plan of an amp level: which modules own a policy, and in which dtypes.

:func:`plan_level` decides it from the level's spec without touching the model;
:func:`~mixprec.amp.initialize` applies it. :func:`low_params` names the parameters a
plan stores in low precision.

>>> import torch
>>> from mixprec.amp._level_specs import LEVEL_SPECS
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
>>> plan = plan_level(net, LEVEL_SPECS["O2"], torch.bfloat16, (), (torch.nn.LayerNorm,))
>>> [(type(m).__name__, str(p)) for m, p, _ in plan]
[('Sequential', 'p=bf16,c=bf16,o=f32'), ('LayerNorm', 'p=f32,c=f32,o=bf16')]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mixprec._checks import LOW_PRECISION as _LOW
from mixprec.amp._cast_hooks import get_state
from mixprec.amp._module_policy import walk_region
from mixprec.policy import Policy

if TYPE_CHECKING:
    from mixprec.amp._level_specs import LevelSpec

def plan_level(
    model: nn.Module,
    spec: LevelSpec,
    dtype: torch.dtype,
    white: tuple[type[nn.Module], ...],
    black: tuple[type[nn.Module], ...],
) -> list[tuple[nn.Module, Policy, bool]]:
    """The owners and policies that the level ``spec`` gives ``model`` (no change to the model).

    ::

        r0 <- f32 where the level stores float32 (O0, O1), else low; the root itself
              listed: flip it as below
        root <- (param dtype of r0's regions, r0, f32)
        walk(module, region dtype r):
            child has a user policy: keep it, skip its subtree
            r != low and child in white: child <- (p, low, out(low, r)); walk(child, low)
            (r == low or autocast) and child in black: child <- (f32, f32, out(f32, r)); walk(child, f32)
            else: walk(child, r)

    with ``p`` float32 where the level stores float32 (O1: parameters cast on the fly)
    and ``low`` where it stores low (O2, O3), and ``out(own, r)`` the child's own dtype
    for a level with autocast's rules (O1: an allow-listed op's output stays low for the
    next one, a deny-listed op casts up and returns float32) and the region's ``r``
    otherwise (the model around the child keeps its dtype). O1 with the default lists
    is planned with empty ones (plus the normalisation types for
    ``keep_batchnorm_fp32=True``): ``torch.autocast`` decides the rest.
    """
    f32 = torch.float32
    autocast_rules = spec.forward == "autocast"
    white_param = f32 if spec.storage == "float32" else dtype
    root_dtype = white_param
    root_param = root_dtype
    # The model may itself be a listed module (amp.initialize(nn.Linear(...)), "O1").
    if root_dtype != dtype and white and isinstance(model, white):
        root_dtype, root_param = dtype, white_param
    elif root_dtype == dtype and black and isinstance(model, black):
        root_dtype = root_param = f32
    plan = [
        (model, Policy(param_dtype=root_param, compute_dtype=root_dtype, output_dtype=f32), False)
    ]

    def walk(module: nn.Module, region: torch.dtype, seen: set[int]) -> None:
        for child in module._modules.values():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            state = get_state(child)
            if state is not None and state.policy is not None and state.user_policy:
                continue
            if region != dtype and white and isinstance(child, white):
                out = dtype if autocast_rules else region
                policy = Policy(param_dtype=white_param, compute_dtype=dtype, output_dtype=out)
                plan.append((child, policy, False))
                walk(child, dtype, seen)
            elif (region == dtype or autocast_rules) and black and isinstance(child, black):
                out = f32 if autocast_rules else region
                plan.append((child, Policy(param_dtype=f32, output_dtype=out), False))
                walk(child, f32, seen)
            else:
                walk(child, region, seen)

    walk(model, root_dtype, {id(model)})
    return plan


def low_params(model: nn.Module, plan: list[tuple[nn.Module, Policy, bool]]) -> set[int]:
    """Ids of the parameters the plan stores in low precision."""
    owners = {id(m) for m, _, _ in plan}
    owners |= {id(m) for m in model.modules() if (s := get_state(m)) and s.policy is not None}
    low: set[int] = set()
    for owner, policy, _ in plan:
        if policy.param_dtype in _LOW:
            for module in walk_region(owner, owners - {id(owner)}):
                low |= {id(p) for p in module._parameters.values() if p is not None}
    return low

