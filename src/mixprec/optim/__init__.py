"""The optimizer side of mixed precision.

* :class:`LossScaleOptimizer` - wraps any ``torch.optim.Optimizer``: loss scaling,
  overflow skipping, master weights, clipping, EMA, accumulation, ranks that agree.
* :func:`joint_step` - step optimizers that share a loss scale as one.
* :class:`GradScaler` - a drop-in for ``torch.amp.GradScaler`` over the same engine.
* :class:`CheckpointState` - ``torch.distributed.checkpoint`` of a model and its
  ``LossScaleOptimizer`` (loaded on first use).
* :class:`AdamW8bit` - AdamW with 8-bit moments (2 bytes of state per parameter).
* :class:`Split8MasterWeights` - the ``"split8"`` masters: bfloat16 weight + int8 correction.
* :class:`GradientRelease` - each parameter stepped during ``backward()``, gradients freed.
* :mod:`mixprec.optim.masters` - what is stepped: the master-weight modes, one
  protocol (:class:`~mixprec.optim.masters.Masters`) and one registry
  (:data:`~mixprec.optim.masters.MODES`).

The modules behind them are internal: ``_loss_scale_optimizer`` (the wrapper and its
step pipeline), ``_clipping``, ``_ema``, ``_accumulation``, ``_grad_scaler``,
``_distributed_checkpoint``, ``_adamw8bit``, ``_flat_params`` and ``_release``; the
loss-scale protocol they share is :mod:`mixprec.loss_scale`, and the formulas
(AdamW's update, the bit codecs) are :mod:`mixprec.kernels`'.
"""

from typing import Any

from mixprec.optim._adamw8bit import AdamW8bit
from mixprec.optim._grad_scaler import GradScaler
from mixprec.optim._loss_scale_optimizer import LossScaleOptimizer, joint_step
from mixprec.optim._release import GradientRelease
from mixprec.optim.masters import Split8MasterWeights

__all__ = [
    "GradScaler", "LossScaleOptimizer", "joint_step", "CheckpointState", "AdamW8bit",
    "Split8MasterWeights", "GradientRelease",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint is heavy: load it when it is asked for.
    if name == "CheckpointState":
        from mixprec.optim._distributed_checkpoint import CheckpointState

        return CheckpointState
    raise AttributeError(f"module 'mixprec.optim' has no attribute {name!r}")
