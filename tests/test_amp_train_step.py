"""TrainStep, and MindSpore's build_train_network / TrainOneStepCell over it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import amp
from mixprec.compat import mindspore as ms
from mixprec.compat.mindspore import DynamicLossScaleManager, FixedLossScaleManager
from mixprec.loss_scale import DynamicLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.train import TrainStep


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Small tensors: one thread avoids OpenMP hand-offs that dominate on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def data(seed=1, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


@pytest.mark.parametrize(
    "level, dtype",
    [("O0", torch.float32), ("O1", torch.float16), ("O2", torch.bfloat16), ("O3", torch.bfloat16)],
)
def test_train_step_learns_and_returns_a_float32_loss(level, dtype):
    model = net()
    step = ms.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        F.cross_entropy,
        level,
        dtype=torch.float16 if dtype == torch.float32 else dtype,
    )
    x, y = data()
    losses = [step(x, y) for _ in range(30)]
    assert all(loss.dtype == torch.float32 and not loss.requires_grad for loss in losses)
    assert float(losses[-1]) < 0.6 * float(losses[0])
    assert int(step.optimizer.iterations) + int(step.optimizer.skipped_steps) == 30


def test_overflowing_float16_step_is_skipped_and_the_scale_backs_off():
    model = net()
    step = ms.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, "O2"
    )
    assert isinstance(step.optimizer.loss_scaler, DynamicLossScale)
    before = [p.detach().clone() for p in model.parameters()]
    scale = float(step.optimizer.loss_scale)
    x, y = data()
    loss = step(x * 1e6, y)  # 1e6 is inf in float16
    assert not torch.isfinite(loss)
    assert int(step.optimizer.skipped_steps) == 1 and int(step.optimizer.iterations) == 0
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert float(step.optimizer.loss_scale) == scale / 2
    step(x, y)
    assert int(step.optimizer.iterations) == 1


def test_sens_step_equals_the_unscaled_step():
    # The seed's CustomTrainOneStepCell: grads of d(loss)*sens, multiplied by 1/sens.
    x, y = data()
    plain, scaled = net(), net()
    a = TrainStep(plain, torch.optim.SGD(plain.parameters(), lr=0.1), F.cross_entropy)
    b = ms.CustomTrainOneStepCell(scaled, torch.optim.SGD(scaled.parameters(), lr=0.1), 1024.0, loss_fn=F.cross_entropy)
    for _ in range(3):
        torch.testing.assert_close(a(x, y), b(x, target=y))
    for p, q in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(p, q)


def test_scale_grad_is_the_override_point():
    class KeepSens(ms.CustomTrainOneStepCell):  # MindSpore's base TrainOneStepCell keeps it
        def scale_grad(self, grads):
            pass

    x, y = data()
    a, b = net(), net()
    keep = KeepSens(a, torch.optim.SGD(a.parameters(), lr=0.0), 4.0, loss_fn=F.cross_entropy)
    undo = ms.CustomTrainOneStepCell(b, torch.optim.SGD(b.parameters(), lr=0.0), 4.0, loss_fn=F.cross_entropy)
    keep(x, y)
    undo(x, y)
    torch.testing.assert_close(a[0].weight.grad, 4.0 * b[0].weight.grad)


class WithLoss(nn.Module):
    """MindSpore's WithLossCell: the network returns its loss."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, x, y):
        return F.cross_entropy(self.backbone(x), y)


def test_network_with_its_own_loss_and_sens_on_a_low_precision_model():
    model = WithLoss(net())
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "O3", torch.bfloat16
    )
    step = ms.CustomTrainOneStepCell(model, opt, 128.0)
    x, y = data()
    first = step(x, y)
    for _ in range(20):
        last = step(x, y)
    assert last.dtype == torch.float32 and float(last) < float(first)


def test_loss_scale_manager_forms():
    model = net()
    step = ms.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        F.cross_entropy,
        "O2",
        FixedLossScaleManager(64.0, False),
    )
    assert isinstance(step.optimizer.loss_scaler, StaticLossScale)
    assert float(step.optimizer.loss_scale) == 64.0 and step.optimizer.skip_nonfinite is False
    model = net()
    step = ms.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        F.cross_entropy,
        "O1",
        DynamicLossScaleManager(init_loss_scale=2.0**10, scale_window=50),
    )
    assert isinstance(step.optimizer.loss_scaler, DynamicLossScale) and float(step.optimizer.loss_scale) == 1024.0
    assert step.optimizer.loss_scaler.growth_interval == 50
    model = net()
    step = ms.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, "O0", 8
    )
    assert float(step.optimizer.loss_scale) == 8.0 and model[0].weight.dtype == torch.float32


def test_bad_arguments():
    model = net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="-1"):
        ms.CustomTrainOneStepCell(model, sgd, -1, loss_fn=F.cross_entropy)
    with pytest.raises(TypeError, match="sens"):
        ms.CustomTrainOneStepCell(model, sgd, True, loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match="already scales"):
        ms.CustomTrainOneStepCell(model, LossScaleOptimizer(sgd), 8.0, loss_fn=F.cross_entropy)
    with pytest.raises(TypeError, match="loss_fn"):
        TrainStep(model, sgd, "mse")
    with pytest.raises(TypeError, match="optimizer"):
        ms.build_train_network(model, "sgd", F.cross_entropy, "O1")
    step = TrainStep(model, sgd, F.cross_entropy)
    x, y = data()
    with pytest.raises(TypeError, match="target"):
        step(x)
    with pytest.raises(TypeError, match="unexpected keyword"):
        step(x, y, labels=y)
    bad = TrainStep(model, sgd, lambda out, t: out)
    with pytest.raises(ValueError, match="one-element"):
        bad(x, y)
    before = [(p.dtype, p.detach().clone()) for p in model.parameters()]
    with pytest.raises(ValueError, match="O5"):
        ms.build_train_network(model, sgd, F.cross_entropy, "O5")
    assert all(
        p.dtype == d and torch.equal(p.detach(), v) for p, (d, v) in zip(model.parameters(), before)
    )
