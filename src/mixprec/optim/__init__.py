"""The optimizer side of mixed precision.

* :class:`LossScaleOptimizer` - wraps any ``torch.optim.Optimizer``: loss scaling,
  overflow skipping, master weights, clipping, EMA, accumulation, ranks that agree.
* :func:`joint_step` - step optimizers that share a loss scale as one.
* :class:`GradScaler` - a drop-in for ``torch.amp.GradScaler`` over the same engine.
* :class:`CheckpointState` - ``torch.distributed.checkpoint`` of a model and its
  ``LossScaleOptimizer`` (loaded on first use).

The modules behind them are internal: ``_loss_scale_optimizer`` (the wrapper and its
step), ``_masters`` (what is stepped: the master-weight modes), ``_clipping``,
``_ema``, ``_accumulation``, ``_grad_scaler`` and ``_distributed_checkpoint``; the
step protocol they share is :mod:`mixprec.loss_scale`.
"""

from typing import Any

from mixprec.optim._grad_scaler import GradScaler
from mixprec.optim._loss_scale_optimizer import LossScaleOptimizer, joint_step

__all__ = ["GradScaler", "LossScaleOptimizer", "joint_step", "CheckpointState"]


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint is heavy: load it when it is asked for.
    if name == "CheckpointState":
        from mixprec.optim._distributed_checkpoint import CheckpointState

        return CheckpointState
    raise AttributeError(f"module 'mixprec.optim' has no attribute {name!r}")
