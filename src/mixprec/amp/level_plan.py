"""The plan of an amp level: which modules own a policy, and in which dtypes.

:func:`plan_level` decides it without touching the model; ``amp.initialize`` applies
it. :func:`low_params` names the parameters a plan stores in low precision.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.amp.cast_hooks import get_state
from mixprec.amp.module_policy import _walk_region
from mixprec.dtypes import LOW_PRECISION as _LOW
from mixprec.policy import Policy

__all__ = ["plan_level", "low_params"]


def plan_level(
    model: nn.Module,
    level: str,
    dtype: torch.dtype,
    white: tuple[type[nn.Module], ...],
    black: tuple[type[nn.Module], ...],
) -> list[tuple[nn.Module, Policy, bool]]:
    """The owners and policies that ``level`` gives ``model`` (no change to the model).

    ::

        r0 <- f32 for O0/O1, low for O2/O3; the root itself listed: flip it as below
        root <- (param dtype of r0's regions, r0, f32)
        walk(module, region dtype r):
            child has a user policy: keep it, skip its subtree
            r != low and child in white: child <- (p, low, out(low, r)); walk(child, low)
            (r == low or O1) and child in black: child <- (f32, f32, out(f32, r)); walk(child, f32)
            else: walk(child, r)

    with ``p`` float32 in O1 (parameters cast on the fly) and ``low`` in O2/O3, and
    ``out(own, r)`` the child's own dtype in O1 (as ``torch.autocast``: an allow-listed
    op's output stays low for the next one, a deny-listed op casts up and returns
    float32) and the region's ``r`` in O2/O3 (the model around the child keeps its dtype).
    """
    f32 = torch.float32
    white_param = f32 if level == "O1" else dtype
    root_dtype = f32 if level in ("O0", "O1") else dtype
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
                out = dtype if level == "O1" else region
                policy = Policy(param_dtype=white_param, compute_dtype=dtype, output_dtype=out)
                plan.append((child, policy, False))
                walk(child, dtype, seen)
            elif (region == dtype or level == "O1") and black and isinstance(child, black):
                out = f32 if level == "O1" else region
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
            for module in _walk_region(owner, owners - {id(owner)}):
                low |= {id(p) for p in module._parameters.values() if p is not None}
    return low
