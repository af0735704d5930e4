"""Refusing a step on gradients that never went through a scaled loss.

Code that calls ``loss.backward()`` itself (a trainer that does not know the loss
scale) leaves unscaled gradients; dividing them by the scale would train at about
1/scale of the learning rate without a word. The optimizers ask their loss scale
(host-side, no sync) whether a loss was scaled since their last step, and call
:func:`refuse_unscaled_gradients` when none was.

>>> import torch
>>> from mixprec.loss_scale import DynamicLossScale, NoOpLossScale
>>> groups = [{"params": [], "lr": 0.1}]
>>> refuse_unscaled_gradients(NoOpLossScale(), groups)   # scale 1: nothing to refuse
>>> refuse_unscaled_gradients(DynamicLossScale(), groups)
Traceback (most recent call last):
...
RuntimeError: step() was called, but no loss was scaled since the last step: ...
"""

from __future__ import annotations

from typing import Any

from mixprec.loss_scale import LossScale

__all__ = ["refuse_unscaled_gradients"]


def refuse_unscaled_gradients(loss_scale: LossScale, param_groups: list[dict[str, Any]]) -> None:
    """Raise ``RuntimeError``: these gradients would be divided by the scale.

    Allowed (returns): a scale that is a fixed 1, and a step at learning rate 0 in
    every group, which changes nothing and is how distributed-checkpoint tools
    (``torch.distributed.checkpoint.state_dict``) create optimizer state.
    """
    if not loss_scale.needs_scaled_loss:
        return
    if all(float(g.get("lr", 1.0)) == 0.0 for g in param_groups):
        return
    raise RuntimeError(
        "step() was called, but no loss was scaled since the last step: the gradients "
        f"would be divided by the loss scale ({float(loss_scale.scale):g}) and training "
        "would crawl. Call opt.scale_loss(loss).backward() instead of loss.backward() "
        "(scaler.scale(loss).backward() with a GradScaler), let a trainer integration "
        "(mixprec.integrations) scale the loss, or use loss_scale=None"
    )
