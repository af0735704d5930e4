"""Optimizer wrappers: loss scaling, master weights, clipping, EMA, accumulation.

* :class:`LossScaleOptimizer` - wraps any ``torch.optim.Optimizer`` (``loss_scale_optimizer``).
* :func:`joint_step` - step optimizers that share a loss scale as one (``joint``).
* :class:`GradScaler` - a drop-in for ``torch.amp.GradScaler`` (``grad_scaler``).
* The parts it is made of, one module each: ``wrapper`` (a real ``Optimizer`` in front
  of another), ``options``, ``master_weights`` (``split_masters``, ``lean``: the
  cheaper master-weight modes), ``clipping``, ``ema``, ``accumulation``,
  ``checkpoint``, ``distributed`` (ranks that agree, sharded parameters, ``no_sync``) and
  ``distributed_checkpoint`` (``torch.distributed.checkpoint``).
"""

from mixprec.optim.accumulation import GradientAccumulator
from mixprec.optim.ema import ParameterEMA
from mixprec.optim.grad_scaler import GradScaler
from mixprec.optim.joint import joint_step
from mixprec.optim.lean import LeanUpdates
from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer
from mixprec.optim.master_weights import MasterWeights
from mixprec.optim.split_masters import SplitMasterWeights
from mixprec.optim.wrapper import OptimizerWrapper

__all__ = [
    "GradScaler",
    "LossScaleOptimizer",
    "joint_step",
    "MasterWeights",
    "SplitMasterWeights",
    "LeanUpdates",
    "OptimizerWrapper",
    "ParameterEMA",
    "GradientAccumulator",
]
