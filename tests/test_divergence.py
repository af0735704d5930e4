"""Divergence is never silent: NaN losses, non-finite weights and a collapsed loss scale
stop ``Model.train`` with a clear error (no extra host sync per step), the command exits
3 with one line after saving what it has, and float16 optimizer state with an ``eps``
below float16's range is refused up front."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mixprec import DynamicLossScale, Model, ScaleCollapseError, amp
from mixprec.cli import main
from mixprec.tools import HostSyncCounter
from mixprec.train import DivergenceError, DivergenceGuard
from mixprec.train.callbacks import Callback, ModelCheckpoint, RunState
from mixprec.train.data import train_test_loaders
from mixprec.train.models import MLP


def digits(batch_size=256):
    return train_test_loaders(batch_size=batch_size, seed=0, image=False)[0]


def mlp(seed=0):
    torch.manual_seed(seed)
    return MLP(64, hidden=(16,), num_classes=10)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mixprec", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


# -- the guard, one call at a time -------------------------------------------------------


def test_the_loss_streak_counts_only_consecutive_non_finite_losses():
    guard = DivergenceGuard(loss_steps=3, check_every=None)
    net = nn.Linear(2, 2)
    for step, loss in enumerate([math.nan, math.inf, 0.5, math.nan, math.nan], start=1):
        guard.after_step(RunState(epoch=1, step=step, loss=loss), net, None)
    assert guard.bad_losses == 2
    with pytest.raises(DivergenceError, match="epoch 1, step 6: the loss was NaN or inf for the"):
        guard.after_step(RunState(epoch=1, step=6, loss=-math.inf), net, None)


def test_the_weight_check_names_the_parameter_or_optimizer_state():
    net = nn.Linear(2, 2)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    guard = DivergenceGuard(loss_steps=None, check_every=1)
    guard.after_step(RunState(step=1, loss=1.0), net, opt)  # all finite: no error
    opt.state[net.bias]["exp_avg_sq"][0] = math.inf
    with pytest.raises(DivergenceError, match="optimizer state 'exp_avg_sq' of param_groups"):
        guard.after_step(RunState(step=2, loss=1.0), net, opt)
    with torch.no_grad():
        net.weight[0, 0] = math.nan
    with pytest.raises(DivergenceError, match="parameter weight holds NaN or inf"):
        guard.check_weights(RunState(step=3), net, opt)


@pytest.mark.parametrize("kwargs", [{"loss_steps": 0}, {"check_every": -1}, {"loss_steps": 2.5}])
def test_guard_arguments_are_checked(kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        DivergenceGuard(**kwargs)


# -- in Model.train ----------------------------------------------------------------------


class InfiniteLearningRateFrom(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_begin(self, state):
        if state.epoch == self.epoch:
            state.optimizer.param_groups[0]["lr"] = math.inf


def test_an_infinite_learning_rate_stops_training_before_a_nan_checkpoint(tmp_path):
    net = mlp()
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    callbacks = [InfiniteLearningRateFrom(epoch=2), ModelCheckpoint(tmp_path)]
    # Step 7 (epoch 2's first) makes the weights inf; step 8's loss is the first NaN.
    with pytest.raises(DivergenceError, match=r"epoch 2, step 8: parameter layers\.\d\.\w+ holds"):
        model.train(3, digits(), callbacks=callbacks)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch0001.pt"]
    assert not all(torch.isfinite(p).all() for p in net.parameters())  # really diverged


def test_applying_non_finite_steps_on_purpose_turns_the_default_guard_off():
    """skip_nonfinite=False (MindSpore's drop_overflow_update=False) applies inf updates
    by request: no error by default, one with divergence=True."""
    for divergence in (None, True):
        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=math.inf)
        model = Model(net, optimizer=opt, skip_nonfinite=False, divergence=divergence)
        if divergence is None:
            model.train(1, digits())
            assert not all(torch.isfinite(p).all() for p in net.parameters())
        else:
            with pytest.raises(DivergenceError):
                model.train(1, digits())


def test_the_guard_can_be_turned_off():
    net = mlp()
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=math.inf), divergence=False)
    model.train(1, digits())
    assert math.isnan(model.history.losses[-1])


def test_the_guard_adds_no_host_sync_per_step():
    """Syncs with the guard minus without: one per epoch end and one per check_every steps."""
    counts = []
    for divergence in (False, DivergenceGuard(loss_steps=20, check_every=5)):
        net = mlp()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)  # skips on the device
        model = Model(net, optimizer=opt, divergence=divergence)
        train = digits()
        model.train(1, train)  # warm up lazily built state outside the count
        with HostSyncCounter() as syncs:
            model.train(3, train)
        counts.append(syncs.count)
    steps = 3 * len(train)
    assert counts[1] - counts[0] == 3 + steps // 5, counts  # 3 epoch ends, every 5th step


class AlwaysOverflows(nn.Module):
    """An MLP whose weight gradients are inf on every step (loss finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.net.layers[-1].weight.register_hook(lambda g: torch.full_like(g, math.inf))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("fused", [False, True])
def test_a_collapsed_loss_scale_stops_training(fused):
    net = AlwaysOverflows()
    model = Model(
        net,
        optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused),
        loss_scale=DynamicLossScale(initial_scale=8.0, min_scale=1.0, collapse_after=4),
    )
    with pytest.raises(ScaleCollapseError, match="4 steps in a row overflowed"):
        model.train(2, digits(batch_size=128))
    assert model.history.skipped == [True] * len(model.history.skipped)
    assert float(model.optimizer.loss_scale) == 1.0


# -- float16 optimizer state with an eps below float16's range ---------------------------


def test_adam_state_in_float16_with_eps_1e_8_really_breaks_the_weights():
    """The reference for the refusal below: O3 by hand, one applied step, NaN weights."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2).half()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)  # eps=1e-8 rounds to 0 in float16
    net.weight.grad = torch.zeros_like(net.weight)  # e.g. a dead unit: m = v = 0
    net.bias.grad = torch.ones_like(net.bias)
    opt.step()
    assert not torch.isfinite(net.weight).all()


@pytest.mark.parametrize("level", ["O3", "lean"])
def test_float16_state_with_adams_default_eps_is_refused_and_changes_nothing(level):
    net = mlp()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    match = rf"param group 0 has eps=1e-08, below float16's .*: {level} with master_weights="
    with pytest.raises(ValueError, match=match):
        amp.initialize(net, torch.optim.AdamW(net.parameters()), level, torch.float16)
    assert amp.get_policy(net) is None
    for key, value in net.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[key]), key


@pytest.mark.parametrize(
    "level, dtype, make_opt",
    [
        ("O3", torch.float16, lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-4)),
        ("O3", torch.float16, lambda p: torch.optim.SGD(p, lr=0.1)),
        ("O3", torch.bfloat16, lambda p: torch.optim.AdamW(p, lr=1e-2)),
        ("O2", torch.float16, lambda p: torch.optim.AdamW(p, lr=1e-2)),
    ],
    ids=["fp16-eps1e-4", "fp16-sgd", "bf16-adamw", "o2-fp16-adamw"],
)
def test_combinations_that_keep_the_weights_finite_are_accepted(level, dtype, make_opt):
    net = mlp()
    net, opt = amp.initialize(net, make_opt(net.parameters()), level, dtype)
    x, y = next(iter(digits(batch_size=64)))
    for _ in range(3):
        loss = nn.functional.cross_entropy(net(x), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    assert int(opt.iterations) == 3 and all(torch.isfinite(p).all() for p in net.parameters())


# -- the command: exit 3 with one line, after saving what it has -------------------------


def test_a_diverging_run_exits_3_in_one_line_after_saving_what_it_has(tmp_path):
    out = tmp_path / "run"
    args = ["--model", "mlp", "--epochs", "2", "--threads", "1", "--quiet", "--device", "cpu"]
    proc = run_cli("train", "--lr", "1e30", "--out", str(out), *args)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("mixprec: diverged: training diverged at epoch 1")
    assert "lower learning rate" in lines[0]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["diverged"] in lines[0] and metrics["test_accuracy"] is None
    assert len(metrics["history"]["loss"]) == metrics["steps"] > 20
    # Strict JSON: the NaN losses are nulls, and non_finite says so.
    assert metrics["history"]["loss"][-1] is None
    assert "NaN" in metrics["non_finite"]["history.loss"]
    for name in ("config.json", "loss.png", "accuracy.png", "loss_scale.png"):
        assert (out / name).is_file(), name
    assert list((out / "checkpoints").iterdir()) == []  # epoch 1 never finished


def test_a_collapsed_loss_scale_exits_3_and_keeps_the_finished_epochs(
    tmp_path, monkeypatch, capsys
):
    """Every step's gradients overflow: the default dynamic scale (2**15, halved on each
    overflow down to 1) counts as collapsed after 100 more overflowing steps at 1, in the
    third epoch of 41 steps."""
    forward = MLP.forward

    def overflowing(self, x):
        out = forward(self, x)
        if self.training:
            out.register_hook(lambda g: g * math.inf)
        return out

    monkeypatch.setattr(MLP, "forward", overflowing)
    out = tmp_path / "run"
    argv = ["--model", "mlp", "--batch-size", "32", "--epochs", "3", "--quiet", "--device", "cpu"]
    argv += ["--loss-scale", "dynamic", "--out", str(out)]
    assert main(["train", *argv]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixprec: diverged: the loss scale collapsed")
    metrics = json.loads((out / "metrics.json").read_text())
    assert all(metrics["history"]["skipped"]) and metrics["final_loss_scale"] == 1.0
    done, steps_per_epoch = metrics["epochs"], 41
    assert done >= 1 and metrics["steps"] > done * steps_per_epoch  # stopped mid-epoch
    kept = [f"epoch{e:04d}.pt" for e in range(max(1, done - 1), done + 1)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept
