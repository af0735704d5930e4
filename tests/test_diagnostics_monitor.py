"""The training-time GradientMonitor and the PrecisionMonitor callback: samples on schedule,
fractions equal to a direct count of the gradients the optimizer received, no host sync
between samples, overflowing layers named, metrics recorded, the loss-scale plot."""

from __future__ import annotations

import io
import json
import weakref

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import LossScaleOptimizer, Model, amp
from mixprec.diagnostics import GradientMonitor
from mixprec.tools import HostSyncCounter
from mixprec.train import plot_loss_scale, read_plot_data
from mixprec.train.callbacks import CSVLogger, History, PrecisionMonitor


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def step(net, opt, x, y) -> None:
    loss = nn.functional.cross_entropy(net(x).float(), y)
    (opt.scale_loss(loss) if isinstance(opt, LossScaleOptimizer) else loss).backward()
    opt.step()
    opt.zero_grad()


def data(n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))] * n


class GradTap:
    """The gradients each step() receives, copied by a hook registered before the monitor's."""

    def __init__(self, opt, params) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.params = params
        opt.register_step_pre_hook(self.copy)

    def copy(self, opt, args, kwargs) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in self.params})


def test_samples_follow_the_schedule_and_match_a_direct_count(one_thread):
    net = mlp()
    net, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", "bf16",
                              loss_scale="dynamic")
    tap = GradTap(opt, list(net.named_parameters()))
    monitor = GradientMonitor(opt, net, every=3, dtype=torch.float16)
    for x, y in data(7):
        step(net, opt, x, y)
    samples = monitor.read_samples()
    assert [s.step for s in samples] == [1, 4, 7] and monitor.steps == 7
    assert monitor.read_samples() == [] and monitor.history == samples
    for sample in samples:
        grads = tap.steps[sample.step - 1]  # bfloat16 model gradients, still scaled
        assert set(sample.layers) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert sample.loss_scale == float(opt.loss_scale) == 2.0**15
        for name, g in grads.items():
            g = g.double()
            under = ((g.abs() < 2.0**-14) & (g != 0)).double().mean().item()
            over = g.half().isinf().double().mean().item()
            assert sample.layers[name]["underflow_fraction"] == pytest.approx(under, abs=1e-12)
            assert sample.layers[name]["overflow_fraction"] == pytest.approx(over, abs=1e-12)
            assert sample.layers[name]["zero_fraction"] == (g == 0).double().mean().item()
        every = torch.cat([g.double().flatten() for g in grads.values()])
        nonzero = every[every != 0].abs().log2().floor()
        unscaled = (int(nonzero.min()) - 15, int(nonzero.max()) - 15)
        assert sample.exponent_range == unscaled


def test_no_host_sync_between_samples_with_a_fused_optimizer():
    def run(monitored: bool) -> list[int]:
        net = mlp()
        opt = LossScaleOptimizer(torch.optim.AdamW(net.parameters(), fused=True))
        if monitored:
            monitor = GradientMonitor(opt, net, every=4)
        counts = []
        for x, y in data(9):
            with HostSyncCounter() as syncs:
                step(net, opt, x, y)
            counts.append(syncs.count)
        if monitored:
            assert monitor.pending == 3  # steps 1, 5, 9: sampled on the device, not read
        return counts

    bare, monitored = run(False), run(True)
    # Sampled steps (1, 5, 9) and the others alike: exactly the syncs of the bare optimizer
    # (its first step creates state), none after it.
    assert monitored == bare and monitored[1:] == [0] * 8


def test_overflowing_gradients_are_named():
    net = mlp()
    opt = LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    monitor = GradientMonitor(opt, net)
    x, y = data(1)[0]
    step(net, opt, x, y)
    assert monitor.nonfinite() == []
    handle = net[2].weight.register_hook(lambda g: g * float("inf"))
    step(net, opt, x, y)
    assert bool(opt.last_step_skipped) and monitor.nonfinite() == ["2.weight"]
    handle.remove()
    # The references end at the model's next forward: no second set of gradients lives
    # through the next backward pass.
    kept = weakref.ref(monitor._last[0][1][0])
    net(x)
    assert kept() is None and monitor.nonfinite() == []
    monitor.remove()
    step(net, opt, x, y)
    assert monitor.steps == 2  # the hook is off


def test_names_come_from_the_model_the_optimizer_or_positions():
    net = mlp()
    master = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", "bf16")[1]
    named = torch.optim.SGD(mlp().named_parameters(), lr=0.1)
    plain = torch.optim.SGD(mlp().parameters(), lr=0.1)
    names = {
        "model": GradientMonitor(master, net)._names,
        "param_names": GradientMonitor(named)._names,
        "positions": GradientMonitor(plain)._names,
    }
    assert names["model"] == names["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert names["positions"][1] == "param_groups[0][1]"


def test_bad_arguments_are_rejected():
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        GradientMonitor("sgd")
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        GradientMonitor(opt, every=0)
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        GradientMonitor(opt, dtype=torch.float32)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        GradientMonitor(opt, model="net")
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        PrecisionMonitor(every=-1)
    assert not opt._optimizer_step_pre_hooks


# -- the callback in a training run -------------------------------------------------------


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def test_the_callback_records_samples_overflows_and_epoch_metrics(tmp_path, one_thread):
    net = mlp()
    poisoned_steps = {3, 8}
    calls = {"n": 0}

    def poison(g):  # the second layer's gradient overflows on chosen steps
        calls["n"] += 1
        return g * float("inf") if calls["n"] in poisoned_steps else g

    net[2].weight.register_hook(poison)
    out = io.StringIO()
    monitor = PrecisionMonitor(every=4, dtype=torch.bfloat16, file=out)
    history = History()
    model = Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1),
                  amp_level="O2", dtype=torch.bfloat16)  # fmt: skip
    model.train(2, loader(), callbacks=[monitor, history, CSVLogger(tmp_path / "m.csv")])
    assert [s["step"] for s in monitor.samples] == [1, 5, 9]
    assert [o["step"] for o in monitor.overflows] == [3, 8]
    assert all(o["layers"] == ["2.weight"] for o in monitor.overflows)
    assert "overflow in `2.weight` gradient" in out.getvalue()
    assert history.metrics["grad_overflow_steps"] == [1.0, 1.0]
    assert len(history.metrics["grad_underflow"]) == 2
    assert "grad_underflow" in (tmp_path / "m.csv").read_text().splitlines()[0]
    assert monitor.monitor is None and not model.optimizer._optimizer_step_pre_hooks
    summary = json.loads(json.dumps(monitor.summary()))
    assert summary["dtype"] == "bfloat16" and len(summary["samples"]) == 3
    restored = PrecisionMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.samples == monitor.samples and restored.overflows == monitor.overflows


def test_the_loss_scale_plot_shows_the_underflow_fraction(tmp_path):
    path = tmp_path / "scale.png"
    plot_loss_scale([4.0, 2.0, 2.0], [False, True, False], path, underflow=([1, 3], [0.25, 0.5]))
    data = read_plot_data(path)
    assert data["underflow_steps"] == [1, 3] and data["underflow_fractions"] == [0.25, 0.5]
    assert data["skipped_steps"] == [2]
    assert Image.open(path).size[0] > 300


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_device_sync_between_or_at_samples_on_cuda(dtype):
    net = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 10))
    net, opt = amp.initialize(net.cuda(), torch.optim.AdamW(net.parameters(), fused=True),
                              "O2", dtype)  # fmt: skip
    monitor = GradientMonitor(opt, net, every=5, dtype=dtype)
    x = torch.randn(64, 64, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    for _ in range(3):  # optimizer state, first sample
        step(net, opt, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):  # steps 4..15, samples at 6 and 11
            step(net, opt, x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [s.step for s in monitor.read_samples()] == [1, 6, 11]
    assert monitor.nonfinite() == []
