"""Keras 3's LossScaleOptimizer tests, re-expressed against ``mixprec.compat.keras``:
``get_config()`` keys, ``from_config()`` as ``cls(inner_optimizer, **config)``,
``dynamic=True`` accepted and ``dynamic=False`` refused, ``iterations`` assignable."""

import json

import pytest
import torch

from mixprec.compat.keras import LossScaleOptimizer
from mixprec.compat.mindspore import Momentum


def make(**kwargs):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return net, LossScaleOptimizer(inner, **kwargs)


def test_get_config_has_keras_keys_and_a_nested_inner_optimizer():
    _, opt = make(initial_scale=16.0, dynamic_growth_steps=3, name="ls")
    config = opt.get_config()
    assert config == {
        "name": "ls",
        "inner_optimizer": config["inner_optimizer"],
        "initial_scale": 16.0,
        "dynamic_growth_steps": 3,
    }
    inner = config["inner_optimizer"]
    assert inner["class_name"] == "SGD" and inner["module"].startswith("torch.optim")
    assert inner["config"]["lr"] == 0.1 and inner["config"]["momentum"] == 0.9
    assert "params" not in inner["config"] and "param_groups" not in inner


def test_from_config_rebuilds_an_equivalent_optimizer_that_trains_the_same():
    net, opt = make(initial_scale=16.0, dynamic_growth_steps=3, name="ls", clipnorm=0.5)
    config = json.loads(json.dumps(opt.get_config()))  # Keras configs are JSON
    twin_net = torch.nn.Linear(3, 2)
    twin_net.load_state_dict(net.state_dict())
    twin = LossScaleOptimizer.from_config(config, params=twin_net.parameters())
    assert twin.get_config() == opt.get_config()
    assert twin.inner_optimizer.defaults == opt.inner_optimizer.defaults
    x = torch.randn(4, 3)
    for model, o in ((net, opt), (twin_net, twin)):
        for _ in range(3):
            o.scale_loss(model(x).square().sum()).backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin_net.parameters()))


def test_base_options_set_to_other_than_their_defaults_round_trip():
    _, opt = make(weight_decay=0.01, clipvalue=1.0, use_ema=True, ema_momentum=0.9,
                  loss_scale_factor=2.0, gradient_accumulation_steps=2)  # fmt: skip
    config = opt.get_config()
    for key, value in dict(weight_decay=0.01, clipvalue=1.0, use_ema=True, ema_momentum=0.9,
                           loss_scale_factor=2.0, gradient_accumulation_steps=2).items():  # fmt: skip
        assert config[key] == value, key
    assert "clipnorm" not in config and "ema_overwrite_frequency" not in config
    _, params = make()
    twin = LossScaleOptimizer.from_config(config, params=params.param_groups[0]["params"])
    assert twin.get_config() == config
    opt.weight_decay = 0.02  # the config holds the values of now
    assert opt.get_config()["weight_decay"] == 0.02


def test_dynamic_true_is_accepted_and_false_refused_as_keras_3():
    _, opt = make(dynamic=True)
    assert opt.dynamic
    with pytest.raises(ValueError, match="no longer supports dynamic=False.*loss_scale_factor"):
        make(dynamic=False)
    with pytest.raises(TypeError, match="dynamic must be True or False"):
        make(dynamic="yes")


def test_iterations_is_assignable():
    net, opt = make()
    opt.iterations = 5
    assert int(opt.iterations) == 5
    opt.scale_loss(net(torch.ones(1, 3)).sum()).backward()
    opt.step()
    assert int(opt.iterations) == 6


def test_dir_lists_the_delegated_hyperparameters():
    names = dir(make()[1])
    assert {"lr", "momentum", "dynamic_scale", "step_counter", "inner_optimizer"} <= set(names)


def test_an_optimizer_that_cannot_be_rebuilt_from_its_hyperparameters_is_named():
    net = torch.nn.Linear(2, 2)
    opt = LossScaleOptimizer(Momentum(net.parameters(), learning_rate=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="Momentum cannot be rebuilt.*learning_rate"):
        opt.get_config()
