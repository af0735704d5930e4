"""One serialization round trip for every class with ``get_config``/``from_config``:
every loss-scale class (the core's and the TensorFlow compat ones, found by walking
the subclasses, so a new class cannot be left out) and the compat loss-scale
optimizers. As Keras's ``run_class_serialization_test``: the config survives JSON,
rebuilds an object with the same config and the same ``dir()``, and with the state
loaded the two continue identically."""

import copy
import json

import pytest
import torch

import mixprec.compat  # noqa: F401  (imports every compat loss-scale class)
from mixprec import loss_scale as core
from mixprec.compat import keras, tf

LOSS_SCALES = {
    core.NoOpLossScale: lambda: core.NoOpLossScale(),
    core.StaticLossScale: lambda: core.StaticLossScale(512.0),
    core.DynamicLossScale: lambda: core.DynamicLossScale(hysteresis=2, min_scale=None),
    tf.DynamicLossScale: lambda: tf.DynamicLossScale(8.0, 3, 4.0),
    tf.FixedLossScale: lambda: tf.FixedLossScale(123),
}


def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)


def test_every_loss_scale_class_is_covered():
    assert set(subclasses(core.LossScale)) == set(LOSS_SCALES)


def json_round_trip(config):
    return json.loads(json.dumps(config))


def public_dir(obj):
    return [name for name in dir(obj) if name != "__annotations__"]


@pytest.mark.parametrize("cls", list(LOSS_SCALES), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_loss_scale_round_trip(cls):
    original = LOSS_SCALES[cls]()
    for overflow in (0.0, 1.0, 0.0, 0.0):
        original.update(found_inf=torch.tensor(overflow))
    config = json_round_trip(original.get_config())
    clone = cls.from_config(config)
    assert type(clone) is cls
    assert json_round_trip(clone.get_config()) == config
    assert public_dir(clone) == public_dir(original)
    clone.load_state_dict(original.state_dict())
    assert repr(clone) == repr(original)
    for overflow in (0.0, 0.0, 0.0, 1.0, 0.0):
        original.update(found_inf=torch.tensor(overflow))
        clone.update(found_inf=torch.tensor(overflow))
        assert torch.equal(original.scale, clone.scale)
        assert clone.state_dict().keys() == original.state_dict().keys()


def train(opt, net, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.scale_loss(net(torch.randn(4, 3)).square().sum()).backward()
        opt.step()
        opt.zero_grad()


OPTIMIZERS = {
    "tf-dynamic": lambda p: tf.LossScaleOptimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                                  initial_scale=64.0, dynamic_growth_steps=2),
    "tf-fixed": lambda p: tf.LossScaleOptimizer(torch.optim.Adam(p, lr=0.01), dynamic=False,
                                                initial_scale=32.0),
    "keras": lambda p: keras.LossScaleOptimizer(torch.optim.AdamW(p, lr=0.01), initial_scale=64.0,
                                                dynamic_growth_steps=2, clipnorm=1.0, name="k"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compat_optimizer_round_trip(name):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    twin_net = torch.nn.Linear(3, 2)
    twin_net.load_state_dict(net.state_dict())
    original = OPTIMIZERS[name](net.parameters())
    train(original, net)
    config = json_round_trip(original.get_config())
    clone = type(original).from_config(config, params=twin_net.parameters())
    assert type(clone) is type(original)
    assert json_round_trip(clone.get_config()) == config
    assert public_dir(clone) == public_dir(original)
    twin_net.load_state_dict(net.state_dict())
    # A deep copy: torch's load_state_dict keeps tensors it need not move, so the two
    # optimizers would otherwise share (and both update) one set of moments.
    clone.load_state_dict(copy.deepcopy(original.state_dict()))
    train(original, net)
    train(clone, twin_net)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin_net.parameters()))
    assert torch.equal(original.loss_scale, clone.loss_scale)
