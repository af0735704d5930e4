"""Optimizer wrappers: loss scaling, master weights, clipping, EMA, accumulation."""

from mixprec.optim.accumulation import GradientAccumulator
from mixprec.optim.ema import ParameterEMA
from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer, joint_step
from mixprec.optim.master_weights import MasterWeights

__all__ = [
    "LossScaleOptimizer",
    "joint_step",
    "MasterWeights",
    "ParameterEMA",
    "GradientAccumulator",
]
