"""``joint_step``: step several optimizers that share one loss scale as one."""

from __future__ import annotations

import torch

from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["joint_step"]


def joint_step(*optimizers: LossScaleOptimizer) -> None:
    """Step several optimizers that share one loss scale as one: skip all or none.

    The alternative to calling each ``opt.step()`` (where each optimizer skips only its
    own overflowing step, and each step advances the shared scale). Here every
    optimizer's gradients are unscaled and checked first; if any overflowed, all
    steps are skipped; then the shared scale is updated once.

    >>> w1, w2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    >>> from mixprec.loss_scale import DynamicLossScale
    >>> shared = DynamicLossScale(initial_scale=4.0)
    >>> a = LossScaleOptimizer(torch.optim.SGD([w1], lr=0.1), shared)
    >>> b = LossScaleOptimizer(torch.optim.SGD([w2], lr=0.1), shared)
    >>> a.scale_loss(w1.sum()).backward(); b.scale_loss(w2.sum() * float("inf")).backward()
    >>> joint_step(a, b)
    >>> float(w1.detach()), float(shared.scale)  # b overflowed: both skipped, scale halved
    (1.0, 2.0)
    """
    if not optimizers or not all(isinstance(o, LossScaleOptimizer) for o in optimizers):
        raise TypeError("joint_step takes one or more LossScaleOptimizer objects")
    if len({id(o.loss_scaler) for o in optimizers}) != 1:
        raise ValueError(
            "joint_step needs optimizers that share one loss scale "
            "(build them with loss_scale=<the same LossScale object>)"
        )
    if any(o.gradient_accumulation_steps for o in optimizers):
        raise ValueError("joint_step does not combine with gradient_accumulation_steps")
    params = [o._stepped_params() for o in optimizers]
    flags = [o._prepare(p) for o, p in zip(optimizers, params)]
    found_inf = torch.stack([f.to(flags[0].device) for f in flags]).amax()
    for o, p in zip(optimizers, params):
        o._apply(p, found_inf)
    optimizers[0].loss_scaler.update(found_inf=found_inf)
