"""The checkpoint of a ``LossScaleOptimizer``: everything it needs to resume bit-exactly.

One dict with the inner optimizer's state dict, the loss scale's kind, config and
state, the step counters and the optional parts (master weights, EMA, gradient
accumulation). :func:`load_state` checks everything before it changes anything.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["optimizer_state", "load_state"]

_KEYS = {"inner", "loss_scale", "counters", "master", "ema", "accumulation"}
_PARTS = (("master", "_master"), ("ema", "_ema"), ("accumulation", "_accumulator"))


def optimizer_state(opt: Any) -> dict[str, Any]:
    """The state dict of the ``LossScaleOptimizer`` ``opt``."""
    parts = {key: getattr(opt, attr) for key, attr in _PARTS}
    return {
        "inner": opt.inner_optimizer.state_dict(),
        "loss_scale": {
            "kind": type(opt.loss_scaler).__name__,
            "config": opt.loss_scaler.get_config(),
            "state": opt.loss_scaler.state_dict(),
        },
        "counters": {
            "iterations": opt.iterations.clone(),
            "skipped_steps": opt.skipped_steps.clone(),
            "last_step_skipped": opt.last_step_skipped.clone(),
        },
        **{key: None if part is None else part.state_dict() for key, part in parts.items()},
    }


def load_state(opt: Any, state_dict: Any) -> None:
    """Restore :func:`optimizer_state`'s output into ``opt``; raise ``ValueError`` first
    if it does not fit (another kind of loss scale, a missing or extra part)."""
    if not isinstance(state_dict, dict) or set(state_dict) != _KEYS:
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"not a LossScaleOptimizer state dict: expected keys {sorted(_KEYS)}, got {got}"
        )
    kind, mine = state_dict["loss_scale"]["kind"], type(opt.loss_scaler).__name__
    if kind != mine:
        raise ValueError(
            f"the checkpoint's loss scale is a {kind}, this optimizer's is a {mine}; "
            "build the optimizer the same way"
        )
    for key, attr in _PARTS:
        part = getattr(opt, attr)
        if (state_dict[key] is None) != (part is None):
            raise ValueError(
                f"the checkpoint was saved {'without' if state_dict[key] is None else 'with'} "
                f"{key} but this optimizer is configured {'with' if part else 'without'} it"
            )
    opt.inner_optimizer.load_state_dict(state_dict["inner"])
    opt.loss_scaler.load_state_dict(state_dict["loss_scale"]["state"])
    counters = state_dict["counters"]
    opt.skipped_steps = counters["skipped_steps"].clone().to(opt.skipped_steps.device)
    opt._steps_taken = int(counters["iterations"] + counters["skipped_steps"])
    opt._last_found_inf = torch.as_tensor(counters["last_step_skipped"]).float()
    for key, attr in _PARTS:
        part = getattr(opt, attr)
        if part is not None:
            part.load_state_dict(state_dict[key])
