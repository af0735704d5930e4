"""mixprec.Model (and the MindSpore-named Model with its loss-scale managers): training,
evaluation, resume, overflow policy."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec import DynamicLossScale, Model, StaticLossScale
from mixprec.compat.mindspore import DynamicLossScaleManager, FixedLossScaleManager
from mixprec.compat.mindspore import Model as MindSporeModel
from mixprec.train.callbacks import LossMonitor, ModelCheckpoint
from mixprec.train.data import make_loaders, train_test_loaders
from mixprec.train.models import MLP


def digits(batch_size=64):
    return train_test_loaders(batch_size=batch_size, seed=0, image=False)


def mlp(seed=0):
    torch.manual_seed(seed)
    return MLP(64, hidden=(64,), num_classes=10)


# -- managers ---------------------------------------------------------------------------


def test_manager_defaults_follow_the_seed():
    fixed = FixedLossScaleManager()
    assert fixed.get_loss_scale() == 128.0 and fixed.get_drop_overflow_update() is True
    dyn = DynamicLossScaleManager()
    ls = dyn.build_loss_scale()
    assert isinstance(ls, DynamicLossScale)
    assert float(ls.scale) == 2.0**24 and ls.growth_interval == 2000 and ls.growth_factor == 2.0
    custom = DynamicLossScaleManager(scale_factor=4, scale_window=3000).build_loss_scale()
    assert (custom.growth_factor, custom.backoff_factor, custom.growth_interval) == (
        4.0,
        0.25,
        3000,
    )


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: FixedLossScaleManager(0.5), "loss_scale"),
        (lambda: FixedLossScaleManager(128.0, "no"), "drop_overflow_update"),
        (lambda: DynamicLossScaleManager(scale_factor=1), "scale_factor"),
        (lambda: DynamicLossScaleManager(scale_window=0), "scale_window"),
        (lambda: DynamicLossScaleManager(init_loss_scale=-2.0), "init_loss_scale"),
    ],
)
def test_manager_validation_names_the_argument(factory, match):
    with pytest.raises((ValueError, TypeError), match=match):
        factory()


class InjectInf(torch.nn.Module):
    """Linear model whose backward puts an inf in the weight gradient on chosen calls."""

    def __init__(self, bad_calls):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 2)
        self.calls, self.bad_calls = 0, set(bad_calls)
        self.fc.weight.register_hook(self._hook)

    def _hook(self, grad):
        self.calls += 1
        if self.calls in self.bad_calls:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("drop", [True, False])
def test_fixed_manager_drop_overflow_update(drop):
    net = InjectInf(bad_calls={2})
    data = [(torch.ones(8, 4), torch.zeros(8, dtype=torch.long))] * 3
    model = MindSporeModel(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        amp_level="O0",
        loss_scale_manager=FixedLossScaleManager(1024.0, drop),
    )
    model.train(1, data[:1])
    before = net.fc.weight.detach().clone()
    model.train(1, data[1:2])  # the overflowing step
    after = net.fc.weight.detach()
    if drop:
        assert torch.equal(before, after) and int(model.optimizer.skipped_steps) == 1
    else:  # MindSpore's drop_overflow_update=False: the update is applied anyway
        assert not torch.isfinite(after).all() and int(model.optimizer.skipped_steps) == 0
    assert float(model.optimizer.loss_scale) == 1024.0


@pytest.mark.parametrize("skip", [True, False])
def test_static_loss_scale_and_skip_nonfinite(skip):
    net = InjectInf(bad_calls={2})
    data = [(torch.ones(8, 4), torch.zeros(8, dtype=torch.long))] * 3
    model = Model(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        amp_level="O0",
        loss_scale=1024.0,
        skip_nonfinite=skip,
    )
    model.train(1, data[:1])
    before = net.fc.weight.detach().clone()
    model.train(1, data[1:2])  # the overflowing step
    after = net.fc.weight.detach()
    if skip:
        assert torch.equal(before, after) and int(model.optimizer.skipped_steps) == 1
    else:
        assert not torch.isfinite(after).all() and int(model.optimizer.skipped_steps) == 0
    assert float(model.optimizer.loss_scale) == 1024.0


def test_dynamic_manager_backs_off_on_overflow():
    net = InjectInf(bad_calls={1, 2})
    data = [(torch.ones(8, 4), torch.zeros(8, dtype=torch.long))] * 4
    model = MindSporeModel(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_scale_manager=DynamicLossScaleManager(init_loss_scale=2.0**10, scale_factor=4),
    )
    hist = model.train(1, data)
    assert hist.skipped == [True, True, False, False]
    assert hist.loss_scales == [256.0, 64.0, 64.0, 64.0]


# -- training and evaluation ------------------------------------------------------------


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "rewrite"])
def test_levels_train_the_digits(level):
    train, test = digits()
    net = mlp()
    model = Model(
        net,
        torch.nn.CrossEntropyLoss(),
        torch.optim.AdamW(net.parameters(), lr=3e-3),
        metrics=["accuracy", "loss"],
        amp_level=level,
        dtype=torch.bfloat16,
    )
    hist = model.train(4, train, eval_dataset=test)
    result = model.eval(test)
    assert result["accuracy"] > 0.9, result
    assert hist.metrics["val_accuracy"][-1] == pytest.approx(result["accuracy"])
    assert hist.metrics["loss"][-1] < hist.metrics["loss"][0]
    pred = model.predict(test.dataset.tensors[0][:5])
    assert pred.dtype == torch.float32 and pred.shape == (5, 10)


def test_loss_monitor_prints_the_seed_line():
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    net = mlp()
    buf = io.StringIO()
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01))
    model.train(2, make_loaders(x, y, 32), callbacks=[LossMonitor(file=buf)])
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and lines[1].startswith("epoch: 1 step: 2, loss is ")
    assert lines[3].startswith("epoch: 2 step: 2, loss is ")


def test_one_hot_targets_like_the_seed():
    x = torch.randn(64, 64)
    labels = torch.randint(0, 10, (64,))
    onehot = torch.nn.functional.one_hot(labels, 10).float()
    net = mlp()
    model = Model(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        amp_level="O3",
        dtype=torch.bfloat16,
    )
    hist = model.train(2, DataLoader(TensorDataset(x, onehot), batch_size=16))
    assert len(hist.losses) == 8 and all(torch.isfinite(torch.tensor(hist.losses)))


def test_resume_continues_exactly(tmp_path):
    def fresh():
        train, _ = digits(batch_size=128)
        net = mlp()
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
        return MindSporeModel(
            net,
            optimizer=opt,
            amp_level="O2",
            dtype=torch.bfloat16,
            loss_scale_manager=DynamicLossScaleManager(2.0**12, 2, 5),
        ), train

    model_a, train_a = fresh()
    model_a.train(4, train_a)

    model_b, train_b = fresh()
    model_b.train(2, train_b, callbacks=[ModelCheckpoint(tmp_path)])
    model_c, train_c = fresh()
    torch.manual_seed(1234)  # a different global RNG: resume must restore it
    hist = model_c.train(4, train_c, resume=tmp_path / "epoch0002.pt")
    for pa, pc in zip(model_a.network.parameters(), model_c.network.parameters()):
        assert torch.equal(pa, pc)
    assert torch.equal(model_a.optimizer.loss_scale, model_c.optimizer.loss_scale)
    assert len(hist.losses) == 4 * len(train_c)  # history restored, then continued


def test_resume_rejects_another_configuration(tmp_path):
    train, _ = digits(batch_size=256)
    net = mlp()
    model = Model(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        amp_level="O1",
        dtype=torch.bfloat16,
    )
    model.train(1, train, callbacks=[ModelCheckpoint(tmp_path)])
    other = Model(mlp(), optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1), amp_level="O0")
    with pytest.raises(ValueError, match="amp_level"):
        other.train(2, train, resume=tmp_path / "epoch0001.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        other.train(2, train, resume=tmp_path / "missing.pt")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"amp_level": "O4"}, ValueError, "amp_level"),
        ({"dtype": torch.float64}, ValueError, "dtype"),
        ({"optimizer": "sgd"}, TypeError, "optimizer"),
        ({"metrics": ["f1"]}, ValueError, "metric"),
        ({"loss_scale": "huge"}, ValueError, "loss_scale"),
        ({"skip_nonfinite": "no"}, TypeError, "skip_nonfinite"),
    ],
)
def test_model_validation(kwargs, error, match):
    net = mlp()
    weight = net.layers[1].weight.detach().clone()
    with pytest.raises(error, match=match):
        Model(net, **kwargs)
    assert net.layers[1].weight.dtype == torch.float32 and torch.equal(net.layers[1].weight, weight)


def test_train_validation():
    net = mlp()
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="epochs"):
        model.train(0, [])
    with pytest.raises(ValueError, match="no optimizer"):
        Model(mlp()).train(1, [(torch.zeros(2, 64), torch.zeros(2, dtype=torch.long))])
    with pytest.raises(ValueError, match="pair"):
        model.train(1, [torch.zeros(2, 64)])


def test_static_loss_scale_object_is_accepted():
    net = mlp()
    model = Model(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        amp_level="O2",
        dtype=torch.bfloat16,
        loss_scale=StaticLossScale(256.0),
    )
    assert float(model.optimizer.loss_scale) == 256.0 and model.optimizer.master_weights


def test_a_resumed_run_has_the_whole_epoch_history(tmp_path):
    """The history a checkpoint carries includes the epoch it was saved at: a run
    resumed from epoch 2 of 3 reports epochs 1, 2, 3 (not 1, 3)."""
    def make() -> Model:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        return Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), metrics=["loss"])

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(2)]
    full = make().train(3, data)
    make().train(2, data, callbacks=[ModelCheckpoint(tmp_path)])
    resumed = make().train(3, data, resume=tmp_path / "epoch0002.pt")
    assert resumed.epochs == [1, 2, 3]
    assert resumed.metrics["loss"] == pytest.approx(full.metrics["loss"])
