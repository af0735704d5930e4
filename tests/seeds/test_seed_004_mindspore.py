"""Seed 004: MindSpore mixed precision.

The float16 facts the document states (checked against ``torch.finfo`` and the bit
patterns), then every code example through ``mixprec.compat.mindspore``: the LeNet-5
runs with ``amp_level`` O3/O2, manual mixed precision with ``to_float``, the
``FixedLossScaleManager`` / ``DynamicLossScaleManager`` runs with ``LossMonitor``, the
optimizer-side ``loss_scale`` of ``Momentum``, and the ``CustomTrainOneStepCell`` with
``sens`` run directly and through ``Model``.

The seed's random dataset is used as written (1024 samples of 1x32x32 ``randn``,
one-hot labels, batch 32, ``drop_remainder``). Runs use bfloat16 where the dtype is
ours to pick (float16 convolutions are very slow on CPUs); float16 runs use a few
batches. The seed's full-length runs are marked ``slow``.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

from mixprec.compat import mindspore as ms
from mixprec.train.callbacks import Callback
from mixprec.train.models import LeNet5

LN10 = math.log(10.0)
LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\S+)$")


# -- the seed's dataset and network -----------------------------------------------------


def get_data(num, img_size=(1, 32, 32), num_classes=10, is_onehot=True, seed=0):
    """The seed's generator (seeded here, so that every test sees the same numbers)."""
    rng = np.random.default_rng(seed)
    for _ in range(num):
        img = rng.standard_normal(img_size)
        target = rng.integers(0, num_classes)
        target_ret = np.array([target]).astype(np.float32)
        if is_onehot:
            target_onehot = np.zeros(shape=(num_classes,))
            target_onehot[target] = 1
            target_ret = target_onehot.astype(np.float32)
        yield img.astype(np.float32), target_ret


def create_dataset(num_data=1024, batch_size=32, repeat_size=1):
    """GeneratorDataset -> batch(batch_size, drop_remainder=True) -> repeat(repeat_size)."""
    samples = list(get_data(num_data))
    data = TensorDataset(
        torch.from_numpy(np.stack([s[0] for s in samples])),
        torch.from_numpy(np.stack([s[1] for s in samples])),
    )
    return DataLoader(ConcatDataset([data] * repeat_size), batch_size=batch_size, drop_last=True)


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The seed's examples run on the CPU, where they are bit-exact: a Model built without
    a device would take a GPU where there is one (cuDNN's kernels are not bit-exact)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def ds_train():
    return create_dataset()


@pytest.fixture(scope="module")
def ds_small():
    """The first 8 batches of the seed's dataset, for float16 and repeated runs."""
    return create_dataset(num_data=256)


def _lenet(seed: int = 0) -> LeNet5:
    torch.manual_seed(seed)
    return LeNet5(10, num_channels=1, input_size=32)  # network = LeNet5(10)


def _loss_lines(text: str) -> list[tuple[int, int, str]]:
    """(epoch, step, loss text) of every LossMonitor line."""
    lines = [LINE.match(line) for line in text.splitlines() if line.startswith("epoch:")]
    assert all(lines), text
    return [(int(m[1]), int(m[2]), m[3]) for m in lines]


class _Snapshots(Callback):
    """The parameters after every step."""

    def __init__(self, net: nn.Module) -> None:
        self.net, self.params = net, []

    def on_train_begin(self, state) -> None:
        self.params.append([p.detach().float().clone() for p in self.net.parameters()])

    def on_step_end(self, state) -> None:
        self.params.append([p.detach().float().clone() for p in self.net.parameters()])

    def changed(self, step: int) -> bool:
        """Whether step ``step`` (0-based) changed any parameter."""
        return any(not torch.equal(a, b) for a, b in zip(self.params[step], self.params[step + 1]))


# -- floating-point facts ---------------------------------------------------------------


def test_storage_sizes_fp64_fp32_fp16():
    """FP64 uses 8 bytes, FP32 4 bytes, FP16 2 bytes."""
    sizes = [
        torch.empty((), dtype=d).element_size()
        for d in (torch.float64, torch.float32, torch.float16)
    ]
    assert sizes == [8, 4, 2]


def test_fp16_formula_for_every_normal_bit_pattern():
    """x = (-1)^S * 2^(E-15) * (1 + fraction/1024): 1 sign, 5 exponent, 10 fraction bits."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    sign, exponent, fraction = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
    normal = (exponent >= 1) & (exponent <= 30)
    values = bits.to(torch.int16).view(torch.float16).double()
    formula = (-1.0) ** sign.double() * 2.0 ** (exponent.double() - 15) * (1 + fraction / 1024)
    assert int(normal.sum()) == 2 * 30 * 1024
    assert torch.equal(values[normal], formula[normal])


def test_fp16_maximum_is_65504():
    """0 11110 1111111111 = 1.9990234375 * 2**15 = 65504."""
    largest = torch.tensor(0b0_11110_1111111111, dtype=torch.int16).view(torch.float16)
    assert largest.item() == 65504.0 == torch.finfo(torch.float16).max == 1.9990234375 * 2**15


def test_fp16_smallest_normal_is_2_pow_minus_14():
    """0 00001 0000000000 = 2**-14 = 6.104e-5 (the lower end of FP16's valid range,
    [6.10e-5, 65504])."""
    smallest = torch.tensor(0b0_00001_0000000000, dtype=torch.int16).view(torch.float16)
    assert smallest.item() == 2.0**-14 == torch.finfo(torch.float16).tiny
    assert f"{smallest.item():.3e}" == "6.104e-05"
    assert f"{torch.finfo(torch.float16).tiny:.2e}" == "6.10e-05"


def test_fp16_precision_limit_is_2_pow_minus_24():
    """'the precision range is 2^-24': the smallest subnormal; half of it rounds to 0."""
    assert torch.tensor(2.0**-24, dtype=torch.float16).item() == 2.0**-24
    assert torch.tensor(2.0**-25, dtype=torch.float16).item() == 0.0  # ties to even: 0
    assert torch.tensor(2.0**-26, dtype=torch.float16).item() == 0.0
    # The spacing of FP16 numbers just above 2**-14 is 2**-24 too.
    assert torch.finfo(torch.float16).eps * torch.finfo(torch.float16).tiny == 2.0**-24


def test_fp16_beyond_the_range():
    """Below 2**-24 values become 0, as the document says; above 65504 (+ half a step)
    IEEE float16 gives inf, not 0."""
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    assert torch.tensor(65519.0, dtype=torch.float16).item() == 65504.0
    assert torch.tensor(65520.0, dtype=torch.float16).item() == math.inf
    assert torch.tensor(-70000.0, dtype=torch.float16).item() == -math.inf


def test_fp32_range_endpoints():
    """FP32's valid range per the document: [1.4e-45, 1.7e38]. The lower end is the
    smallest float32 subnormal; the largest float32 is in fact 3.4e38."""
    smallest = torch.tensor(1, dtype=torch.int32).view(torch.float32).item()
    assert f"{smallest:.1e}" == "1.4e-45"
    assert torch.finfo(torch.float32).max == pytest.approx(3.4028e38, rel=1e-4)
    assert torch.tensor(1.7e38, dtype=torch.float32).isfinite()


def test_rounding_error_example():
    """0.00006666666 is represented in FP32 but becomes 0.000067 in FP16."""
    value = 0.00006666666
    fp32 = torch.tensor(value, dtype=torch.float32).item()
    fp16 = torch.tensor(value, dtype=torch.float16).item()
    assert fp32 == pytest.approx(value, rel=1e-7)
    assert fp16 != pytest.approx(value, rel=1e-4)
    assert f"{fp16:.6f}" == "0.000067"
    assert abs(fp16 - value) <= 2.0**-25  # within half the FP16 spacing there (2**-24)


# -- the seed's network and dataset -------------------------------------------------------


def test_lenet5_is_the_seeds_network():
    net = _lenet()
    assert (net.conv1.in_channels, net.conv1.out_channels, net.conv1.kernel_size) == (1, 6, (5, 5))
    assert net.conv1.padding == (0, 0)  # pad_mode='valid'
    assert (net.conv2.in_channels, net.conv2.out_channels, net.conv2.padding) == (6, 16, (0, 0))
    shapes = [(fc.in_features, fc.out_features) for fc in (net.fc1, net.fc2, net.fc3)]
    assert shapes == [(16 * 5 * 5, 120), (120, 84), (84, 10)]
    assert (net.max_pool2d.kernel_size, net.max_pool2d.stride) == (2, 2)
    assert net.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)  # Normal(0.02)
    assert net(torch.randn(3, 1, 32, 32)).shape == (3, 10)


def test_create_dataset_matches_the_seed(ds_train):
    assert len(ds_train) == 1024 // 32
    x, y = next(iter(ds_train))
    assert x.shape == (32, 1, 32, 32) and x.dtype == torch.float32
    assert y.shape == (32, 10) and torch.equal(y.sum(1), torch.ones(32))
    assert len(create_dataset(num_data=1000)) == 31  # drop_remainder=True
    assert len(create_dataset(num_data=64, repeat_size=3)) == 6


# -- automatic mixed precision: Model(..., amp_level=...) ---------------------------------


def _seed_model(network, amp_level, dtype=torch.bfloat16, **kwargs):
    net_loss = ms.SoftmaxCrossEntropyWithLogits(reduction="mean")
    net_opt = ms.Momentum(network.parameters(), learning_rate=0.01, momentum=0.9)
    return ms.Model(
        network,
        net_loss,
        net_opt,
        metrics={"Accuracy": ms.Accuracy()},
        amp_level=amp_level,
        dtype=dtype,
        **kwargs,
    )


def _check_run(capsys, history, epochs, steps):
    lines = _loss_lines(capsys.readouterr().out)
    assert [(e, s) for e, s, _ in lines] == [(e, steps) for e in range(1, epochs + 1)]
    for (_, _, printed), loss in zip(lines, history.losses[steps - 1 :: steps]):
        assert printed == str(np.float32(loss))  # the step's loss, as float32 text
        assert abs(float(printed) - LN10) < 0.1  # random labels: about ln(10) = 2.30
    assert all(math.isfinite(v) for v in history.losses)


@pytest.mark.parametrize("amp_level", ["O3", "O2"])
def test_lenet_amp_level_one_epoch(amp_level, ds_train, capsys):
    network = _lenet()
    model = _seed_model(network, amp_level, loss_scale_manager=None)
    history = model.train(epoch=1, train_dataset=ds_train, callbacks=[ms.LossMonitor(32)])
    _check_run(capsys, history, epochs=1, steps=32)
    assert network.conv1.weight.dtype == network.fc3.weight.dtype == torch.bfloat16
    # O2 brings MindSpore's DynamicLossScaleManager() (2**24; bfloat16 never overflows
    # it); O3 scales nothing.
    assert float(model.optimizer.loss_scale) == (2.0**24 if amp_level == "O2" else 1.0)
    if amp_level == "O2":  # float32 master weights in the optimizer
        assert model.optimizer.param_groups[0]["params"][0].dtype == torch.float32
    metrics = model.eval(ds_train)
    assert 0.0 <= metrics["Accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("amp_level", ["O3", "O2"])
def test_lenet_amp_level_ten_epochs(amp_level, ds_train, capsys):
    network = _lenet()
    model = _seed_model(network, amp_level, loss_scale_manager=None)
    history = model.train(epoch=10, train_dataset=ds_train, callbacks=[ms.LossMonitor(32)])
    _check_run(capsys, history, epochs=10, steps=32)


def test_o2_float16_defaults_to_mindspore_dynamic_manager(ds_small):
    """float16 O2 (MindSpore's own dtype for O2) on a few batches: the level's default
    DynamicLossScaleManager() starts at 2**24, so the first steps overflow and are
    skipped while the scale halves."""
    network = _lenet()
    model = _seed_model(network, "O2", dtype=torch.float16)
    assert float(model.optimizer.loss_scale) == 2.0**24
    snaps = _Snapshots(network)
    history = model.train(epoch=1, train_dataset=ds_small, callbacks=[snaps])
    skipped = sum(history.skipped)
    print(f"\nLeNet-5 O2 float16, initial scale 2**24: {skipped} of 8 steps skipped")
    assert history.skipped[0] and 1 <= skipped < 8
    assert history.loss_scales == [
        2.0 ** (24 - sum(history.skipped[: i + 1])) for i in range(8)
    ]  # halved on each overflow (no growth within scale_window=2000 steps)
    assert [snaps.changed(i) for i in range(8)] == [not s for s in history.skipped]
    assert all(math.isfinite(v) and abs(v - LN10) < 0.2 for v in history.losses)


class ManualLeNet5(LeNet5):
    """The seed's manual-precision LeNet5: ``x = self.cast(x, mstype.float32)`` after conv1."""

    def forward(self, x):
        x = self.conv1(x)
        x = x.float()  # self.cast(x, mstype.float32)
        x = self.relu(x)
        x = self.max_pool2d(x)
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def _manual_network(conv1_dtype=torch.float16):
    torch.manual_seed(0)
    network = ManualLeNet5(10, num_channels=1, input_size=32)
    ms.to_float(network.conv1, conv1_dtype)  # network.conv1.to_float(mstype.float16)
    seen = {}

    def record(module, inputs, output):
        seen["conv1"] = output.dtype

    network.conv1.register_forward_hook(record)
    return network, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_manual_mixed_precision_conv1_to_float16_with_o2(dtype, ds_small, capsys):
    network, seen = _manual_network()
    model = _seed_model(network, "O2", dtype=dtype)
    history = model.train(epoch=2, train_dataset=ds_small, callbacks=[ms.LossMonitor(8)])
    assert seen["conv1"] == torch.float16  # the cell computes in float16
    assert network.conv1.weight.dtype == torch.float32  # its parameters stay float32
    assert network.conv2.weight.dtype == network.fc1.weight.dtype == dtype  # O2: the rest
    lines = _loss_lines(capsys.readouterr().out)
    assert [(e, s) for e, s, _ in lines] == [(1, 8), (2, 8)]
    assert all(math.isfinite(v) and abs(v - LN10) < 0.2 for v in history.losses)
    if dtype == torch.bfloat16:
        assert sum(history.skipped) == 0


@pytest.mark.slow
def test_manual_mixed_precision_seed_run(ds_train, capsys):
    network, seen = _manual_network()
    model = _seed_model(network, "O2")
    history = model.train(epoch=2, train_dataset=ds_train, callbacks=[ms.LossMonitor(32)])
    _check_run(capsys, history, epochs=2, steps=32)
    assert seen["conv1"] == torch.float16


def test_to_float_keeps_float32_parameters():
    conv = nn.Conv2d(1, 6, 5)
    ms.to_float(conv, torch.float16)
    out = conv(torch.randn(2, 1, 32, 32))
    assert out.dtype == torch.float16 and conv.weight.dtype == torch.float32
    ms.to_float(conv, torch.float32)  # back to float32
    assert conv(torch.randn(2, 1, 32, 32)).dtype == torch.float32


def test_batchnorm_and_loss_stay_float32():
    """'Due to precision problems, the BatchNorm operator and operators involved in loss
    still use FP32' (O2); O3 casts BatchNorm too."""
    for level, bn_dtype in (("O2", torch.float32), ("O3", torch.bfloat16)):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 30 * 30, 10),
        )
        model = _seed_model(net, level)
        x, y = torch.randn(8, 1, 32, 32), torch.eye(10)[torch.arange(8)]
        loss, out = model.train_step(x, y)
        assert net[1].weight.dtype == bn_dtype and net[0].weight.dtype == torch.bfloat16
        assert loss.dtype == torch.float32 and math.isfinite(loss.item())


# -- FixedLossScaleManager ----------------------------------------------------------------


def test_fixed_loss_scale_manager_defaults_and_getters():
    manager = ms.FixedLossScaleManager()
    assert manager.get_loss_scale() == 128.0 and manager.get_drop_overflow_update() is True
    manager = ms.FixedLossScaleManager(1024.0, False)
    assert manager.get_loss_scale() == 1024.0 and manager.get_drop_overflow_update() is False
    with pytest.raises(ValueError):
        ms.FixedLossScaleManager(0.5)  # MindSpore: loss_scale must be >= 1
    with pytest.raises(TypeError):
        ms.FixedLossScaleManager(128.0, "no")


def test_fixed_manager_drop_the_update_on_overflow(ds_train):
    """#1) loss_scale_manager = FixedLossScaleManager(); Model(..., amp_level="O0", ...)."""
    network = _lenet()
    model = _seed_model(network, "O0", dtype=None, loss_scale_manager=ms.FixedLossScaleManager())
    assert float(model.optimizer.loss_scale) == 128.0 and model.optimizer.skip_nonfinite
    history = model.train(1, ds_train)
    assert history.loss_scales == [128.0] * 32 and sum(history.skipped) == 0
    assert all(abs(v - LN10) < 0.1 for v in history.losses)


def _seed_fixed_1024(network):
    """#2) loss_scale = 1024.0; FixedLossScaleManager(loss_scale, False);
    Momentum(..., loss_scale=loss_scale); Model(..., amp_level="O0", ...)."""
    loss_scale = 1024.0
    loss_scale_manager = ms.FixedLossScaleManager(loss_scale, False)
    net_opt = ms.Momentum(
        network.parameters(), learning_rate=0.01, momentum=0.9, loss_scale=loss_scale
    )
    return ms.Model(
        network,
        ms.SoftmaxCrossEntropyWithLogits(reduction="mean"),
        net_opt,
        metrics={"Accuracy": ms.Accuracy()},
        amp_level="O0",
        loss_scale_manager=loss_scale_manager,
    )


def test_fixed_manager_execute_update_even_on_overflow_seed_output(ds_train, capsys):
    """model.train(epoch=10, ..., callbacks=[LossMonitor()]) printed 'epoch: 1 step: 32,
    loss is 2.3018966' ... Two epochs here (ten in the slow test)."""
    model = _seed_fixed_1024(_lenet())
    history = model.train(epoch=2, train_dataset=ds_train, callbacks=[ms.LossMonitor()])
    lines = _loss_lines(capsys.readouterr().out)
    # LossMonitor() prints every step (MindSpore 1.x printed once per epoch because
    # its default dataset_sink_mode=True ran the whole epoch as one step).
    assert len(lines) == 64
    epoch_ends = [line for line in lines if line[1] == 32]
    assert [e for e, _, _ in epoch_ends] == [1, 2]
    for _, _, loss in epoch_ends:
        assert abs(float(loss) - LN10) < 0.1
    assert all(math.isfinite(v) for v in history.losses)
    assert history.loss_scales == [1024.0] * 64  # the scale the loss really carries


@pytest.mark.slow
def test_fixed_manager_seed_run_ten_epochs(ds_train, capsys):
    model = _seed_fixed_1024(_lenet())
    model.train(epoch=10, train_dataset=ds_train, callbacks=[ms.LossMonitor(32)])
    lines = _loss_lines(capsys.readouterr().out)
    assert [(e, s) for e, s, _ in lines] == [(e, 32) for e in range(1, 11)]
    assert all(abs(float(loss) - LN10) < 0.1 for _, _, loss in lines)


def test_optimizer_side_loss_scale_gives_the_unscaled_result(ds_small):
    """'the division between the gradient and the loss_scale coefficient is performed in
    the optimizer': the run equals an unscaled float32 run, bit for bit (1024 = 2**10)."""
    net_a = _lenet()
    net_b = copy.deepcopy(net_a)
    _seed_fixed_1024(net_a).train(1, ds_small)
    plain = ms.Momentum(net_b.parameters(), learning_rate=0.01, momentum=0.9)
    ms.Model(net_b, ms.SoftmaxCrossEntropyWithLogits(reduction="mean"), plain).train(1, ds_small)
    assert all(torch.equal(a, b) for a, b in zip(net_a.parameters(), net_b.parameters()))


def test_fixed_manager_without_optimizer_loss_scale_divides_in_the_step(ds_small):
    net_a = _lenet()
    net_b = copy.deepcopy(net_a)
    sgd = torch.optim.SGD(net_a.parameters(), lr=0.01, momentum=0.9)
    manager = ms.FixedLossScaleManager(1024.0, False)
    ms.Model(
        net_a, ms.SoftmaxCrossEntropyWithLogits(reduction="mean"), sgd, loss_scale_manager=manager
    ).train(1, ds_small)
    plain = torch.optim.SGD(net_b.parameters(), lr=0.01, momentum=0.9)
    ms.Model(net_b, ms.SoftmaxCrossEntropyWithLogits(reduction="mean"), plain).train(1, ds_small)
    assert all(torch.equal(a, b) for a, b in zip(net_a.parameters(), net_b.parameters()))


def test_optimizer_and_manager_scales_must_agree():
    net = nn.Linear(4, 3)
    opt = ms.Momentum(net.parameters(), learning_rate=0.01, momentum=0.9, loss_scale=512.0)
    with pytest.raises(ValueError, match="must equal"):
        ms.Model(
            net,
            ms.SoftmaxCrossEntropyWithLogits(),
            opt,
            loss_scale_manager=ms.FixedLossScaleManager(1024.0, False),
        )


def _tiny_fp16_model(manager, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = ms.Model(
        net,
        ms.SoftmaxCrossEntropyWithLogits(reduction="mean"),
        opt,
        amp_level="O2",
        loss_scale_manager=manager,
        dtype=torch.float16,
    )
    gen = torch.Generator().manual_seed(seed)
    data = [
        (torch.randn(16, 8, generator=gen), torch.eye(3)[torch.randint(0, 3, (16,), generator=gen)])
        for _ in range(12)
    ]
    return net, model, data


@pytest.mark.parametrize("drop", [True, False])
def test_drop_overflow_update(drop):
    """drop_overflow_update: whether an overflowing step is skipped (True) or its update
    applied anyway (False)."""
    net, model, data = _tiny_fp16_model(ms.FixedLossScaleManager(2.0**20, drop))
    snaps = _Snapshots(net)
    history = model.train(1, data[:1], callbacks=[snaps])  # 2**20 overflows float16
    if drop:
        assert history.skipped == [True] and not snaps.changed(0)
    else:
        assert history.skipped == [False] and snaps.changed(0)
        assert not all(torch.isfinite(p).all() for p in snaps.params[1])  # inf/NaN applied


# -- DynamicLossScaleManager ----------------------------------------------------------------


def test_dynamic_loss_scale_manager_defaults():
    manager = ms.DynamicLossScaleManager()
    assert (manager.init_loss_scale, manager.scale_factor, manager.scale_window) == (2**24, 2, 2000)
    assert manager.get_loss_scale() == 2.0**24 and manager.get_drop_overflow_update() is True


def test_dynamic_loss_scale_manager_seed_keyword_form(ds_train):
    """scale_factor = 4; scale_window = 3000; DynamicLossScaleManager(...); Model(O0)."""
    scale_factor = 4
    scale_window = 3000
    manager = ms.DynamicLossScaleManager(scale_factor=scale_factor, scale_window=scale_window)
    assert (manager.init_loss_scale, manager.scale_factor, manager.scale_window) == (2**24, 4, 3000)
    network = _lenet()
    model = _seed_model(network, "O0", dtype=None, loss_scale_manager=manager)
    scaler = model.optimizer.loss_scaler
    assert (scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval) == (
        4.0,
        0.25,
        3000,
    )
    history = model.train(1, ds_train)
    assert history.loss_scales == [2.0**24] * 32  # float32: no overflow at 2**24
    assert all(abs(v - LN10) < 0.1 for v in history.losses)


def test_dynamic_loss_scale_manager_positional_pitfall():
    """The seed writes DynamicLossScaleManager(scale_factor, scale_window): positionally
    that binds init_loss_scale=4 and scale_factor=3000 (MindSpore's order is
    init_loss_scale, scale_factor, scale_window), here as in MindSpore."""
    manager = ms.DynamicLossScaleManager(4, 3000)
    assert (manager.init_loss_scale, manager.scale_factor, manager.scale_window) == (4, 3000, 2000)
    assert manager.get_loss_scale() == 4.0


def test_dynamic_manager_rule_on_a_float16_model():
    """'if an overflow occurs, the parameter update is skipped and the value of the scale
    is reduced' by scale_factor; after scale_window steps without overflow it is
    multiplied by scale_factor (never below 1)."""
    manager = ms.DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=4, scale_window=3)
    net, model, data = _tiny_fp16_model(manager)
    snaps = _Snapshots(net)
    history = model.train(1, data, callbacks=[snaps])
    assert history.skipped[0]  # 2**24 overflows float16 at once
    assert 0 < sum(history.skipped) < len(data)
    scale, good = 2.0**24, 0
    for i, (skipped, after) in enumerate(zip(history.skipped, history.loss_scales)):
        assert snaps.changed(i) == (not skipped)
        if skipped:
            scale, good = max(scale / 4, 1.0), 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 4, 0
        assert after == scale, i


@pytest.mark.parametrize(
    "kwargs",
    [{"scale_factor": 1}, {"scale_factor": 0.5}, {"scale_window": 0}, {"init_loss_scale": 0.5}],
)
def test_dynamic_manager_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ms.DynamicLossScaleManager(**kwargs)


# -- Momentum(..., loss_scale=) --------------------------------------------------------------


def test_momentum_signature_defaults():
    import inspect

    params = inspect.signature(ms.Momentum).parameters
    assert list(params) == [
        "params",
        "learning_rate",
        "momentum",
        "weight_decay",
        "loss_scale",
        "use_nesterov",
    ]
    assert (params["weight_decay"].default, params["loss_scale"].default) == (0.0, 1.0)
    assert params["use_nesterov"].default is False


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_divides_gradients_by_its_loss_scale(nesterov):
    a = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    b = nn.Parameter(a.detach().clone())
    opt = ms.Momentum([a], 0.1, 0.9, weight_decay=0.01, loss_scale=1000.0, use_nesterov=nesterov)
    ref = torch.optim.SGD([b], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    for k in range(3):
        g = torch.tensor([0.3, -0.2, 1.0]) * (k + 1)
        a.grad, b.grad = g * 1000.0, g.clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(a.detach(), b.detach())


# -- CustomTrainOneStepCell with sens --------------------------------------------------------


class CustomTrainOneStepCell(ms.TrainOneStepCell):
    """The seed's cell: gradients of loss * sens, multiplied by 1/sens before the step."""

    def __init__(self, network, optimizer, sens=1.0):
        super().__init__(network, optimizer, sens)
        self.reciprocal_sense = 1 / sens

    def scale_grad(self, gradients):
        torch._foreach_mul_(gradients, self.reciprocal_sense)  # gradients / loss_scale


def _custom_cell_setup():
    network = _lenet()
    reference = copy.deepcopy(network)
    net_loss = ms.SoftmaxCrossEntropyWithLogits(reduction="mean")
    # nn.AdamWeightDecay(params, learning_rate=0.01): MindSpore's defaults eps=1e-6, no decay.
    net_opt = torch.optim.AdamW(network.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0)
    loss_scale = 1024.0
    loss_scale_manager = ms.FixedLossScaleManager(loss_scale, False)  # noqa: F841 (as the seed)
    net_with_loss = ms.WithLossCell(network, net_loss)
    net_with_train = CustomTrainOneStepCell(net_with_loss, net_opt, loss_scale)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0)
    return network, net_with_train, reference, ref_opt, net_loss


def _run_custom_cell(ds, epochs):
    network, net_with_train, reference, ref_opt, net_loss = _custom_cell_setup()
    # 1) Execute net_with_train
    for _ in range(epochs):
        for data, label in ds:
            result = net_with_train(data, label)
            ref_loss = net_loss(reference(data), label)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(result, ref_loss.detach())
    # sens=1024 and 1/1024 are exact: the same training as without loss scaling.
    assert all(torch.equal(a, b) for a, b in zip(network.parameters(), reference.parameters()))
    # 2) Define Model and run
    model = ms.Model(net_with_train)
    history = model.train(epoch=epochs, train_dataset=ds)
    assert len(history.losses) == epochs * len(ds)
    assert int(model.optimizer.iterations) == epochs * len(ds)
    assert all(math.isfinite(v) for v in history.losses)
    for _ in range(epochs):  # the reference catches up
        for data, label in ds:
            net_loss(reference(data), label).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(network.parameters(), reference.parameters()))


def test_custom_train_one_step_cell_direct_and_via_model(ds_small):
    _run_custom_cell(ds_small, epochs=2)


@pytest.mark.slow
def test_custom_train_one_step_cell_seed_run(ds_train):
    _run_custom_cell(ds_train, epochs=2)


def test_base_train_one_step_cell_keeps_the_sens_factor():
    """nn.TrainOneStepCell(network, optimizer, sens): the backward starts from sens, and
    the base cell does not divide it back (which is why the seed customises it)."""
    steps = []
    for sens in (1.0, 1024.0):
        torch.manual_seed(0)
        net = nn.Linear(4, 3)
        start = net.weight.detach().clone()
        cell = ms.TrainOneStepCell(
            ms.WithLossCell(net, ms.SoftmaxCrossEntropyWithLogits(reduction="mean")),
            torch.optim.SGD(net.parameters(), lr=1e-3),
            sens,
        )
        cell(torch.ones(2, 4), torch.eye(3)[:2])
        steps.append(net.weight.detach() - start)
    torch.testing.assert_close(steps[1], steps[0] * 1024.0)


def test_model_of_a_train_cell_takes_no_amp_level_or_manager():
    """'the loss_scale_manager and amp_level do not need to be configured'; mixprec refuses
    them, since the cell already holds the whole step."""
    net = nn.Linear(4, 3)
    cell = ms.TrainOneStepCell(
        ms.WithLossCell(net, ms.SoftmaxCrossEntropyWithLogits()),
        torch.optim.SGD(net.parameters(), lr=0.1),
    )
    with pytest.raises(ValueError):
        ms.Model(cell, amp_level="O2")
    with pytest.raises(ValueError):
        ms.Model(cell, loss_scale_manager=ms.FixedLossScaleManager(1024.0, False))


# -- LossMonitor ------------------------------------------------------------------------------


def test_loss_monitor_line_format(capsys):
    from mixprec.train.callbacks import RunState

    monitor = ms.LossMonitor()
    assert monitor.per_print_times == 1
    monitor.on_step_end(RunState(epoch=1, step=32, step_in_epoch=32, loss=2.301896572113037))
    monitor.on_step_end(RunState(epoch=8, step=256, step_in_epoch=32, loss=2.311748))
    assert capsys.readouterr().out.splitlines() == [
        "epoch: 1 step: 32, loss is 2.3018966",
        "epoch: 8 step: 32, loss is 2.311748",
    ]


def test_compat_names_are_the_core_ones():
    """Adapters only: LossMonitor and to_float are the core objects, and the managers
    build the core loss scales."""
    import mixprec
    from mixprec import amp
    from mixprec.train import callbacks

    assert ms.LossMonitor is callbacks.LossMonitor
    assert ms.to_float is amp.to_float
    assert issubclass(ms.Model, mixprec.Model)
    assert isinstance(ms.DynamicLossScaleManager().build_loss_scale(), mixprec.DynamicLossScale)
    assert isinstance(ms.FixedLossScaleManager(128.0).build_loss_scale(), mixprec.StaticLossScale)


# -- the remaining names of the examples ----------------------------------------------------


def test_softmax_cross_entropy_with_logits():
    """nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="none"): one-hot labels by
    default, class indices with sparse=True; always computed in float32."""
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    labels = torch.tensor([0, 2])
    onehot = torch.eye(3)[labels]
    per_sample = -torch.log_softmax(logits, dim=1)[torch.arange(2), labels]
    torch.testing.assert_close(ms.SoftmaxCrossEntropyWithLogits()(logits, onehot), per_sample)
    mean = ms.SoftmaxCrossEntropyWithLogits(reduction="mean")(logits.half(), onehot)
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean, per_sample.mean(), rtol=1e-3, atol=1e-3)
    sparse = ms.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="sum")(logits, labels)
    torch.testing.assert_close(sparse, per_sample.sum())
    with pytest.raises(ValueError):
        ms.SoftmaxCrossEntropyWithLogits(reduction="average")


def test_accuracy_metric_takes_one_hot_labels():
    metric = ms.Accuracy()
    logits = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    metric.update(logits, torch.eye(2)[torch.tensor([0, 1, 1, 1])])
    assert metric.compute() == 0.75


def test_model_positional_signature_and_train_keywords(ds_small, capsys):
    import inspect

    params = list(inspect.signature(ms.Model).parameters)
    assert params[:6] == [
        "network",
        "loss_fn",
        "optimizer",
        "metrics",
        "amp_level",
        "loss_scale_manager",
    ]
    assert inspect.signature(ms.Model).parameters["amp_level"].default == "O0"
    net = _lenet()
    loss = ms.SoftmaxCrossEntropyWithLogits(reduction="mean")
    opt = ms.Momentum(net.parameters(), 0.01, 0.9)
    model = ms.Model(net, loss, opt, {"Accuracy": ms.Accuracy()}, "O0", None)
    # dataset_sink_mode (device-side data sinking) is accepted; every step still reports.
    history = model.train(
        epoch=1, train_dataset=ds_small, callbacks=[ms.LossMonitor()], dataset_sink_mode=True
    )
    assert len(history.losses) == 8
    assert [s for _, s, _ in _loss_lines(capsys.readouterr().out)] == list(range(1, 9))
