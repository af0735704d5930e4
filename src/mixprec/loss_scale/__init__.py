"""Loss scales: small state machines that keep float16 gradients out of underflow.

The parts: :mod:`~mixprec.loss_scale.base` (the interface, the fixed scales),
:mod:`~mixprec.loss_scale.dynamic` and :mod:`~mixprec.loss_scale.spec` (the parser).
Three kinds share one interface, so a trainer never branches on the concrete type:

* :class:`NoOpLossScale` - scale 1, never changes (bfloat16 or float32 training).
* :class:`StaticLossScale` - a fixed scale chosen by the user.
* :class:`DynamicLossScale` - backs off on overflow, grows after a run of finite steps.

Each loss scale keeps its hyperparameters as plain dataclass fields
(``get_config()`` / ``from_config()`` round-trip them) and its state as tensors on
the gradients' device (``state_dict()`` / ``load_state_dict()`` round-trip them).
Both lists are derived from the dataclass fields, so no field can be forgotten.
Updates are branch-free tensor arithmetic: no call here syncs with the device.

>>> import torch
>>> ls = DynamicLossScale(initial_scale=2.0**15, growth_interval=2)
>>> w = torch.ones(2, requires_grad=True)
>>> ls.scale_loss((w * 3).sum()).backward()
>>> found_inf = ls.unscale_([w.grad])
>>> w.grad, found_inf
(tensor([3., 3.]), tensor(0.))
>>> ls.update(found_inf); ls.update(found_inf)   # two finite steps: scale doubles
>>> ls.scale
tensor(65536.)
>>> ls.update(torch.tensor(1.0))                  # an overflow: scale halves
>>> ls.scale
tensor(32768.)
"""

from mixprec.loss_scale.base import LossScale, NoOpLossScale, ScaleCollapseError, StaticLossScale
from mixprec.loss_scale.dynamic import DynamicLossScale
from mixprec.loss_scale.spec import loss_scale_from_spec

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "loss_scale_from_spec",
    "ScaleCollapseError",
]
