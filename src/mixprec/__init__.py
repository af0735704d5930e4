"""mixprec: mixed-precision training for PyTorch.

Loss scaling without host syncs, a loss-scale optimizer that wraps any optimizer,
fp32 master weights, precision policies and amp levels O0-O3, a graph rewrite
with op lists, and a ``Model.train`` front end. The layers, bottom up:

* core - :mod:`mixprec.loss_scale`, :mod:`mixprec.policy`, :mod:`mixprec.numerics`,
  :mod:`mixprec.dtypes`;
* :mod:`mixprec.optim` - :class:`LossScaleOptimizer` and its parts;
* :mod:`mixprec.amp` (module levels and policies) and :mod:`mixprec.rewrite` (fx graph
  rewrite): how a model gets low precision;
* :mod:`mixprec.train` (the ``Model`` loop, callbacks, data, models, metrics, plots) and
  :mod:`mixprec.cli`: the main job;
* :mod:`mixprec.diagnostics` - per-layer underflow/overflow (:func:`diagnose`) and the
  training-time gradient monitor;
* :mod:`mixprec.compat` - the seed systems' names (``tf``, ``keras``, ``mindspore``);
* :mod:`mixprec.integrations` - Lightning, Transformers and Accelerate (optional extras);
* :mod:`mixprec.tools` - host-sync counting, memory readings, local multi-rank runs.

See the README for a tour.
"""

from mixprec import amp, compat, optim, rewrite, tools, train
from mixprec._moved import install_module_aliases, moved_name
from mixprec.diagnostics import diagnose
from mixprec.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    ScaleCollapseError,
    StaticLossScale,
    loss_scale_from_spec,
)
from mixprec.optim import GradScaler, LossScaleOptimizer, joint_step
from mixprec.policy import Policy, global_policy, policy_scope, set_global_policy
from mixprec.train import Model, TrainStep

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "GradScaler",
    "LossScale",
    "LossScaleOptimizer",
    "Model",
    "NoOpLossScale",
    "Policy",
    "ScaleCollapseError",
    "StaticLossScale",
    "TrainStep",
    "amp",
    "compat",
    "diagnose",
    "global_policy",
    "joint_step",
    "loss_scale_from_spec",
    "optim",
    "policy_scope",
    "rewrite",
    "set_global_policy",
    "tools",
    "train",
]

install_module_aliases()


def __getattr__(name: str):  # names this package exported before it had layers
    return moved_name(name)
