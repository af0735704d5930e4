"""mixprec: mixed-precision training for PyTorch.

Loss scaling without host syncs, a loss-scale optimizer that wraps any optimizer,
fp32 master weights, precision policies and amp levels O0-O3, a graph rewrite
with op lists, and a ``Model.train`` front end. See the README for a tour.
"""

from mixprec import amp, compat, rewrite  # noqa: F401  (sub-packages users reach by name)
from mixprec.amp import TrainStep, build_train_network, set_policy, to_float
from mixprec.callbacks import (
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    LossMonitor,
    LossScaleMonitor,
    LRScheduler,
    ModelCheckpoint,
    ProgressBar,
    RunState,
)
from mixprec.data import (
    DataError,
    DataFileNotFoundError,
    load_csv,
    load_digits,
    load_npz,
    make_loaders,
    train_test_loaders,
)
from mixprec.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_from_spec,
)
from mixprec.managers import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
from mixprec.metrics import Accuracy, Loss, Metric, TopKAccuracy, build_metric
from mixprec.models import MLP, MODEL_NAMES, LeNet5, TransformerClassifier, build_model
from mixprec.optim import LossScaleOptimizer, joint_step
from mixprec.policy import Policy, global_policy, policy_scope, set_global_policy
from mixprec.rewrite import (
    AmpLists,
    CaptureError,
    RewriteReport,
    enable_mixed_precision_graph_rewrite,
)
from mixprec.syncs import HostSyncCounter
from mixprec.train import Model

__version__ = "0.1.0"

__all__ = [
    "Accuracy",
    "Callback",
    "CallbackList",
    "CSVLogger",
    "DataError",
    "DataFileNotFoundError",
    "DynamicLossScale",
    "DynamicLossScaleManager",
    "EarlyStopping",
    "AmpLists",
    "CaptureError",
    "RewriteReport",
    "TrainStep",
    "build_train_network",
    "enable_mixed_precision_graph_rewrite",
    "set_policy",
    "to_float",
    "FixedLossScaleManager",
    "History",
    "HostSyncCounter",
    "LeNet5",
    "Loss",
    "LossMonitor",
    "LossScale",
    "LossScaleManager",
    "LossScaleMonitor",
    "LRScheduler",
    "LossScaleOptimizer",
    "MLP",
    "MODEL_NAMES",
    "Metric",
    "Model",
    "ModelCheckpoint",
    "NoOpLossScale",
    "Policy",
    "ProgressBar",
    "RunState",
    "StaticLossScale",
    "TopKAccuracy",
    "TransformerClassifier",
    "amp",
    "build_metric",
    "build_model",
    "compat",
    "global_policy",
    "joint_step",
    "load_csv",
    "load_digits",
    "load_npz",
    "loss_scale_from_spec",
    "make_loaders",
    "policy_scope",
    "rewrite",
    "set_global_policy",
    "train_test_loaders",
]
