"""Validation of ``LossScaleOptimizer``'s options, all at once and before anything changes."""

from __future__ import annotations

from typing import Any

import torch

from mixprec._checks import check_bool, check_number
from mixprec.optim.accumulation import check_accumulation_steps
from mixprec.optim.clipping import check_clip_options
from mixprec.optim.distributed import check_process_group, check_sharded_options
from mixprec.optim.ema import ParameterEMA
from mixprec.optim.lean import LeanUpdates, master_weight_mode
from mixprec.optim.master_weights import MasterWeights
from mixprec.optim.split_masters import SplitMasterWeights

__all__ = ["check_options", "build_master"]


def build_master(inner_optimizer: torch.optim.Optimizer, master_weights: Any) -> Any:
    """The part that owns what is stepped: ``MasterWeights``, ``LeanUpdates`` or ``None``."""
    mode = master_weight_mode(master_weights)
    if mode in ("fp32", "split"):
        return (MasterWeights if mode == "fp32" else SplitMasterWeights)(inner_optimizer)
    return LeanUpdates(inner_optimizer, mode) if mode else None


def check_options(
    inner_optimizer: torch.optim.Optimizer,
    *,
    master_weights: Any,
    clipnorm: Any,
    clipvalue: Any,
    global_clipnorm: Any,
    weight_decay: Any,
    use_ema: Any,
    ema_momentum: Any,
    ema_overwrite_frequency: Any,
    loss_scale_factor: Any,
    gradient_accumulation_steps: Any,
    skip_nonfinite: Any,
    process_group: Any = None,
    monitor_every: Any = None,
) -> int | None:
    """Raise ``TypeError``/``ValueError`` for a bad option; return the accumulation steps.

    >>> import torch
    >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> check_options(sgd, master_weights=False, clipnorm=None, clipvalue=None,
    ...               global_clipnorm=None, weight_decay=None, use_ema=False, ema_momentum=0.99,
    ...               ema_overwrite_frequency=None, loss_scale_factor=None,
    ...               gradient_accumulation_steps=4, skip_nonfinite=True)
    4
    """
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}"
        )
    if hasattr(inner_optimizer, "loss_scaler"):
        raise ValueError(
            "inner_optimizer is already a LossScaleOptimizer; wrap the plain optimizer once"
        )
    check_clip_options(clipnorm, clipvalue, global_clipnorm)
    check_number("monitor_every", monitor_every, integer=True, minimum=1, allow_none=True)
    check_number("weight_decay", weight_decay, minimum=0, allow_none=True)
    check_number(
        "loss_scale_factor", loss_scale_factor, minimum=0, exclusive=True, allow_none=True
    )
    accumulation = check_accumulation_steps(gradient_accumulation_steps)
    check_bool("use_ema", use_ema)
    check_bool("skip_nonfinite", skip_nonfinite)
    if use_ema:
        ParameterEMA([], ema_momentum, ema_overwrite_frequency)  # validates only
    mode = master_weight_mode(master_weights)
    if mode == "fp32":
        MasterWeights.check(inner_optimizer)
    elif mode == "split":
        SplitMasterWeights.check(inner_optimizer)
        if use_ema:
            raise ValueError(
                "use_ema=True needs float32 masters that live between steps; "
                "use master_weights='fp32' with use_ema=True"
            )
    elif mode:
        LeanUpdates.check(inner_optimizer, mode)
    check_process_group(process_group)
    check_sharded_options(inner_optimizer, clipnorm)
    return accumulation
