"""MindSpore's loss-scale managers and cells, re-expressed against
``mixprec.compat.mindspore``: the managers track the current value
(``update_loss_scale``, ``get_loss_scale``, ``get_update_cell``), the update cells and
``TrainOneStepWithLossScaleCell`` have MindSpore's signatures, and all of them run the
core loss scales (no second implementation)."""

import inspect
import random

import numpy as np
import pytest
import torch

from mixprec import loss_scale as core
from mixprec.compat import mindspore as ms


class MindSporeManagerRule:
    """``DynamicLossScaleManager.update_loss_scale`` as MindSpore writes it."""

    def __init__(self, init, factor, window):
        self.loss_scale, self.window = init, window
        self.increase, self.decrease = factor, 1 / factor
        self.cur_iter, self.last_overflow_iter, self.bad_step = 1, 0, 0

    def update(self, overflow):
        if overflow:
            self.loss_scale = max(self.loss_scale * self.decrease, 1)
            self.last_overflow_iter = self.cur_iter
            self.bad_step += 1
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                self.loss_scale *= self.increase
            self.bad_step = 0
        self.cur_iter += 1


class MindSporeCellRule:
    """``DynamicLossScaleUpdateCell.construct`` as MindSpore writes it (select ops)."""

    def __init__(self, factor, window):
        self.factor, self.window = factor, window
        self.cur_iter, self.last_overflow_iter = 1, 0

    def __call__(self, scale, overflow):
        on_overflow = max(scale / self.factor, 1.0) if overflow else scale
        should_inc = self.cur_iter - self.last_overflow_iter >= self.window
        if overflow or should_inc:
            self.last_overflow_iter = self.cur_iter
        scale = on_overflow * self.factor if should_inc and not overflow else on_overflow
        self.cur_iter += 1
        return scale


def patterns():
    rng = random.Random(0)
    return [[rng.random() < p for _ in range(60)] for p in (0.1, 0.3, 0.6)]


@pytest.mark.parametrize("factor, window", [(2, 1), (2, 3), (4, 5)])
def test_dynamic_manager_tracks_the_current_value_by_mindspores_rule(factor, window):
    for pattern in patterns():
        manager = ms.DynamicLossScaleManager(2.0**20, factor, window)
        reference = MindSporeManagerRule(2.0**20, factor, window)
        for overflow in pattern:
            manager.update_loss_scale(overflow)
            reference.update(overflow)
            assert manager.get_loss_scale() == manager.loss_scale == reference.loss_scale


def test_managers_build_and_hand_on_the_current_value():
    manager = ms.DynamicLossScaleManager(1024.0, scale_factor=2, scale_window=3)
    manager.update_loss_scale(True)
    manager.update_loss_scale(torch.tensor(True))  # a flag from the device works too
    assert manager.get_loss_scale() == 256.0
    assert float(manager.build_loss_scale().scale) == 256.0
    assert isinstance(manager.build_loss_scale(), core.DynamicLossScale)
    cell = manager.get_update_cell()
    assert isinstance(cell, ms.DynamicLossScaleUpdateCell)
    assert (cell.get_loss_scale(), cell.scale_factor, cell.scale_window) == (256.0, 2, 3)
    with pytest.raises(TypeError, match="overflow must be a bool"):
        manager.update_loss_scale("yes")
    assert manager.get_loss_scale() == 256.0


def test_fixed_manager_never_moves_and_its_update_cell_follows_drop_overflow_update():
    manager = ms.FixedLossScaleManager(1024.0)
    manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 1024.0
    cell = manager.get_update_cell()
    assert isinstance(cell, ms.FixedLossScaleUpdateCell) and cell.get_loss_scale() == 1024.0
    assert ms.FixedLossScaleManager(1024.0, False).get_update_cell() is None


def test_dynamic_manager_raises_after_bad_step_max_overflows_in_a_row():
    assert ms.DynamicLossScaleManager.bad_step_max == 1000
    manager = ms.DynamicLossScaleManager(2.0**4)
    manager.bad_step_max = 3
    for _ in range(3):
        manager.update_loss_scale(True)
    manager.update_loss_scale(False)  # a finite step ends the streak
    for _ in range(3):
        manager.update_loss_scale(True)
    with pytest.raises(RuntimeError, match="Continuous overflow 4 times"):
        manager.update_loss_scale(True)


def test_update_cells_have_mindspores_signatures():
    assert list(inspect.signature(ms.DynamicLossScaleUpdateCell).parameters) == [
        "loss_scale_value", "scale_factor", "scale_window"]  # fmt: skip
    assert list(inspect.signature(ms.FixedLossScaleUpdateCell).parameters) == ["loss_scale_value"]
    assert list(inspect.signature(ms.TrainOneStepWithLossScaleCell).parameters) == [
        "network", "optimizer", "scale_sense"]  # fmt: skip


@pytest.mark.parametrize("factor, window", [(2, 1), (2, 4), (4, 3)])
def test_dynamic_update_cell_follows_mindspores_construct(factor, window):
    for pattern in patterns():
        cell = ms.DynamicLossScaleUpdateCell(2.0**16, factor, window)
        reference = MindSporeCellRule(factor, window)
        scale, want = torch.tensor(2.0**16), 2.0**16
        for overflow in pattern:
            flag = torch.tensor(overflow)
            assert cell(scale, flag) is flag  # returns overflow
            want = reference(want, overflow)
            assert float(scale) == want
        assert cell.get_loss_scale() == 2.0**16  # the value it was built with
        assert isinstance(cell.loss_scaler, core.DynamicLossScale)


def test_dynamic_update_cell_state_is_in_its_state_dict():
    cell = ms.DynamicLossScaleUpdateCell(64.0, 2, 3)
    scale = torch.tensor([64.0])  # shape (1,) as well as ()
    for overflow in (False, False):
        cell(scale, np.bool_(overflow))
    twin = ms.DynamicLossScaleUpdateCell(64.0, 2, 3)
    twin.load_state_dict(cell.state_dict())
    other = scale.clone()
    cell(scale, False)
    twin(other, False)
    assert float(scale) == float(other) == 128.0  # the third finite step grows both
    with pytest.raises(ValueError, match=r"must be \(1,\) or \(\)"):
        cell(torch.ones(2), False)


def test_fixed_update_cell_returns_overflow_and_leaves_the_scale():
    cell = ms.FixedLossScaleUpdateCell(128.0)
    scale = torch.tensor(128.0)
    assert cell(scale, True) is True and float(scale) == 128.0


def make_step(scale_sense, lr=0.5):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    loss_net = ms.WithLossCell(net, torch.nn.functional.mse_loss)
    step = ms.TrainOneStepWithLossScaleCell(
        loss_net, torch.optim.SGD(net.parameters(), lr), scale_sense
    )
    return net, step


def test_train_cell_step_equals_plain_sgd_and_skips_overflow_with_the_update_cells_rule():
    cell = ms.DynamicLossScaleUpdateCell(1024.0, 2, 1000)
    net, step = make_step(cell)
    assert step.optimizer.loss_scaler is cell.loss_scaler  # the update cell's core loss scale
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(net.state_dict())
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    loss, overflow, used = step(x, y)
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    assert torch.equal(loss, ref_loss.detach()) and not bool(overflow) and float(used) == 1024.0
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))
    before = [p.detach().clone() for p in net.parameters()]
    loss, overflow, used = step(torch.full((4, 3), float("inf")), y)
    assert bool(overflow) and float(used) == 1024.0 and float(step.scale_sense) == 512.0
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))


def test_train_cell_with_a_tensor_scale_keeps_it_and_set_sense_scale_changes_it():
    net, step = make_step(torch.tensor([256.0]))
    _, overflow, used = step(torch.full((2, 3), float("nan")), torch.zeros(2, 1))
    assert bool(overflow) and float(step.scale_sense) == 256.0 == float(used)
    step.set_sense_scale(torch.tensor(64.0))
    assert float(step(torch.ones(2, 3), torch.zeros(2, 1))[2]) == 64.0
    with pytest.raises(TypeError, match="must be Tensor"):
        step.set_sense_scale(64.0)
    with pytest.raises(ValueError, match=r"The shape of 'scale_sense' must be \(1,\) or \(\)"):
        make_step(torch.ones(2))
    with pytest.raises(TypeError, match="must be Cell or Tensor, but got float"):
        make_step(2.0)


def test_growth_past_float32_keeps_the_scale_a_deliberate_difference():
    """MindSpore's cell multiplies without a check and reaches inf (every later loss is
    then inf); the core rule keeps the old scale where growth would overflow, as
    TensorFlow and torch's GradScaler do."""
    cell = ms.DynamicLossScaleUpdateCell(2.0**127, 2, 1)
    scale = torch.tensor(2.0**127)
    cell(scale, False)
    assert float(scale) == 2.0**127
    mindspore_next = MindSporeCellRule(2, 1)(2.0**127, False)
    assert mindspore_next > float(np.finfo(np.float32).max)  # inf in MindSpore's float32


# -- MindSpore's test_amp.py: build_train_network ------------------------------------------


class NetWithLoss(torch.nn.Module):
    """test_amp.py's ``Net``: a dense layer whose ``construct(input_x, label)`` returns the
    MSE loss itself."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.dense = torch.nn.Linear(in_features, out_features)
        self.loss = torch.nn.MSELoss()

    def forward(self, input_x, label):
        return self.loss(self.dense(input_x), label)


def amp_case(level, with_loss_in_network):
    torch.manual_seed(0)
    dense = torch.nn.Linear(16, 16)
    net = NetWithLoss(16, 16)
    net.dense.load_state_dict(dense.state_dict())
    model = net if with_loss_in_network else net.dense
    optimizer = ms.Momentum(model.parameters(), learning_rate=0.1, momentum=0.9)
    if with_loss_in_network:  # test_amp_o0 / test_amp_o2: no loss_fn
        step = ms.build_train_network(net, optimizer, level=level)
    else:  # test_amp_o0_loss / test_amp_o2_loss
        step = ms.build_train_network(net.dense, optimizer, torch.nn.MSELoss(), level=level)
    inputs, label = torch.ones(16, 16), torch.zeros(16, 16)
    return net, step, [step(inputs, label) for _ in range(3)]


def test_build_train_network_takes_a_network_that_returns_its_loss():
    """``build_train_network(network, optimizer, loss_fn=None, level="O0")``: without
    ``loss_fn`` the network's output is the loss, and every argument goes to it. At O0 the
    steps equal those with ``loss_fn`` given and plain torch SGD with momentum, bit for bit;
    at O2 the network is float16 and the loss float32 and falling."""
    net, step, losses = amp_case("O0", with_loss_in_network=True)
    _, _, with_loss_fn = amp_case("O0", with_loss_in_network=False)
    torch.manual_seed(0)
    reference = torch.nn.Linear(16, 16)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for _ in range(3):
        sgd.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(torch.ones(16, 16)), torch.zeros(16, 16))
        loss.backward()
        sgd.step()
        expected.append(loss.detach())
    assert (
        [float(x) for x in losses]
        == [float(x) for x in with_loss_fn]
        == [float(x) for x in expected]
    )
    assert torch.equal(net.dense.weight, reference.weight)
    net, step, losses = amp_case("O2", with_loss_in_network=True)
    assert net.dense.weight.dtype == torch.float16
    assert all(x.dtype == torch.float32 for x in losses) and float(losses[-1]) < float(losses[0])
    assert int(step.optimizer.iterations) + int(step.optimizer.skipped_steps) == 3
    lone = torch.nn.Linear(16, 16)  # a network that does not return its loss
    step = ms.build_train_network(lone, ms.Momentum(lone.parameters(), 0.1, 0.9))
    with pytest.raises(ValueError, match="one-element tensor"):
        step(torch.ones(2, 16))
