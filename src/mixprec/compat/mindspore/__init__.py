"""MindSpore's mixed-precision names, over the mixprec core.

The seed's ``Model(network, loss_fn, optimizer, metrics, amp_level,
loss_scale_manager).train(epoch, dataset)`` and its pieces, in PyTorch:

>>> import torch
>>> from mixprec.compat.mindspore import (Model, FixedLossScaleManager, Momentum,
...     SoftmaxCrossEntropyWithLogits)
>>> net = torch.nn.Linear(4, 3)
>>> opt = Momentum(net.parameters(), learning_rate=0.01, momentum=0.9, loss_scale=1024.0)
>>> model = Model(net, SoftmaxCrossEntropyWithLogits(reduction="mean"), opt,
...               amp_level="O0", loss_scale_manager=FixedLossScaleManager(1024.0, False))
>>> data = [(torch.randn(8, 4), torch.eye(3)[torch.randint(0, 3, (8,))]) for _ in range(4)]
>>> history = model.train(2, data)
>>> len(history.losses)
8
"""

from mixprec.amp import to_float
from mixprec.compat.mindspore._cells import (
    CustomTrainOneStepCell,
    Momentum,
    SoftmaxCrossEntropyWithLogits,
    TrainOneStepCell,
    WithLossCell,
    build_train_network,
)
from mixprec.compat.mindspore._loss_scale_cells import (
    DynamicLossScaleUpdateCell,
    FixedLossScaleUpdateCell,
    TrainOneStepWithLossScaleCell,
)
from mixprec.compat.mindspore._managers import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LossScaleManager,
)
from mixprec.compat.mindspore._model import Model
from mixprec.train.callbacks import LossMonitor
from mixprec.train.metrics import Accuracy

__all__ = [
    "Model",
    "LossScaleManager",
    "FixedLossScaleManager",
    "DynamicLossScaleManager",
    "LossMonitor",
    "Accuracy",
    "to_float",
    "Momentum",
    "SoftmaxCrossEntropyWithLogits",
    "WithLossCell",
    "TrainOneStepCell",
    "CustomTrainOneStepCell",
    "TrainOneStepWithLossScaleCell",
    "FixedLossScaleUpdateCell",
    "DynamicLossScaleUpdateCell",
    "build_train_network",
]
