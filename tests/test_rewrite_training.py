"""Training a rewritten model with loss scaling reaches float32 accuracy (embedded digits)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.compat.tf import enable_mixed_precision_graph_rewrite
from mixprec.loss_scale import DynamicLossScale
from mixprec.train.data import load_digits

pytestmark = pytest.mark.usefixtures("one_thread")


class DigitsMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10)
        )

    def forward(self, x):
        return self.net(x)


class DigitsLeNet(nn.Module):
    """LeNet-5's layout scaled to 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def train_and_test(model_cls, dtype=None, loss_scale="dynamic", epochs=12, lr=0.05, seed=0):
    """Test accuracy after training; float32 when ``dtype`` is None. Also the optimizer.

    The learning rate decays to zero (cosine), so the final weights have settled and
    the accuracies compare the precisions, not where the last epoch stopped.
    """
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    torch.manual_seed(seed)
    model = model_cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    net, opt = model, optimizer
    if dtype is not None:
        net, opt = enable_mixed_precision_graph_rewrite(
            optimizer, loss_scale, model=model, dtype=dtype, example_inputs=(x_train[:8],)
        )
    steps = epochs * -(-len(x_train) // 64)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    order = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        net.train()
        permutation = torch.randperm(len(x_train), generator=order)
        for start in range(0, len(x_train), 64):
            batch = permutation[start : start + 64]
            loss = F.cross_entropy(net(x_train[batch]), y_train[batch])
            if dtype is None:
                loss.backward()
            else:
                opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
    net.eval()
    with torch.no_grad():
        accuracy = (net(x_test).argmax(dim=1) == y_test).float().mean().item()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    return accuracy, opt


@functools.cache
def float32_accuracy(model_cls):
    return train_and_test(model_cls)[0]


@pytest.fixture
def mlp_float32_accuracy():
    return float32_accuracy(DigitsMLP)


def test_float16_with_dynamic_loss_scaling_matches_float32(mlp_float32_accuracy):
    # Starting at the scale ceiling forces overflows: skipped steps and back-offs.
    scale = DynamicLossScale(initial_scale=2.0**24, growth_interval=50)
    accuracy, opt = train_and_test(DigitsMLP, torch.float16, scale)
    assert int(opt.skipped_steps) >= 1 and float(opt.loss_scale) < 2.0**24
    assert accuracy > 0.9, accuracy
    assert abs(accuracy - mlp_float32_accuracy) <= 0.01, (mlp_float32_accuracy, accuracy)


def test_bfloat16_matches_float32(mlp_float32_accuracy):
    accuracy, opt = train_and_test(DigitsMLP, torch.bfloat16)
    assert int(opt.skipped_steps) == 0
    assert abs(accuracy - mlp_float32_accuracy) <= 0.01, (mlp_float32_accuracy, accuracy)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lenet_matches_float32(dtype):
    reference = float32_accuracy(DigitsLeNet)
    accuracy = train_and_test(DigitsLeNet, dtype)[0]
    assert accuracy > 0.9, accuracy
    assert abs(accuracy - reference) <= 0.01, (reference, accuracy)
