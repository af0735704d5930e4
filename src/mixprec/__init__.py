"""mixprec: mixed-precision training for PyTorch.

Loss scaling without host syncs, a loss-scale optimizer that wraps any optimizer,
fp32 master weights, precision policies and amp levels O0-O3, a graph rewrite
with op lists, and a ``Model.train`` front end. The layers, bottom up:

* core - :mod:`mixprec.loss_scale`, :mod:`mixprec.policy`, :mod:`mixprec.numerics`,
  :mod:`mixprec.typing`;
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

``import mixprec`` is cheap: each name below is imported on first use.
The README starts with the common case; the guides in ``docs/`` cover each layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec import amp, compat, optim, rewrite, tools, train
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

__version__ = "0.4.1"

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

_SUBPACKAGES = frozenset({"amp", "compat", "optim", "rewrite", "tools", "train"})
#: Exported name -> the module it comes from, imported on first use.
_LAZY_NAMES = {
    **dict.fromkeys(
        (
            "DynamicLossScale",
            "LossScale",
            "NoOpLossScale",
            "ScaleCollapseError",
            "StaticLossScale",
            "loss_scale_from_spec",
        ),
        "mixprec.loss_scale",
    ),
    **dict.fromkeys(("GradScaler", "LossScaleOptimizer", "joint_step"), "mixprec.optim"),
    **dict.fromkeys(
        ("Policy", "global_policy", "policy_scope", "set_global_policy"), "mixprec.policy"
    ),
    **dict.fromkeys(("Model", "TrainStep"), "mixprec.train"),
    "diagnose": "mixprec.diagnostics",
}


def __getattr__(name: str) -> Any:  # PEP 562: an exported name, imported on first use
    if name in _SUBPACKAGES:
        value: Any = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
