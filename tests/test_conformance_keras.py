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


# -- Keras 3's optimizer_test.py and loss_scale_optimizer_test.py -------------------------


def test_no_gradient_for_any_variable_is_a_value_error_and_changes_nothing():
    """optimizer_test.py's test_empty_gradients: no gradient for any variable is a
    ``ValueError`` and nothing moves (no step counted, the growth counter stays, so empty
    calls never grow the scale); a missing gradient for some of them is a warning, and
    the others are stepped."""
    v = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    v2 = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    opt = LossScaleOptimizer(torch.optim.SGD([v, v2], lr=1.0), dynamic_growth_steps=1)
    for _ in range(3):
        with pytest.raises(ValueError, match="No gradients provided for any variable."):
            opt.apply_gradients([(None, v)])
        with pytest.raises(ValueError, match="No gradients provided for any variable."):
            opt.apply([None, None])
    assert int(opt.iterations) == 0 and int(opt.step_counter) == 0
    assert float(opt.dynamic_scale) == 32768.0 and v.tolist() == [[3.0, 4.0], [5.0, 6.0]]
    scaled_ones = torch.ones(2, 2) * float(opt.dynamic_scale)
    with pytest.warns(
        UserWarning, match=r"Gradients do not exist for variables \[grads_and_vars\[0\]"
    ):
        opt.apply_gradients([(None, v), (scaled_ones, v2)])
    assert v.tolist() == [[3.0, 4.0], [5.0, 6.0]]
    assert v2.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert int(opt.iterations) == 1


def test_scale_loss_of_a_number_is_the_scaled_number():
    """loss_scale_optimizer_test.py's test_downscaling and test_upscaling read the scale
    as ``scale_loss(1.0)``: 400 halved four times is 25; 2 doubled every 2 of 8 finite
    steps is 32. Scaling a number reads the scale and changes nothing."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    opt = LossScaleOptimizer(torch.optim.SGD([p], lr=0.5), initial_scale=400.0)
    for _ in range(4):
        opt.apply([torch.full((4,), float("inf"))], [p])
    scaled = opt.scale_loss(1.0)
    assert isinstance(scaled, torch.Tensor) and scaled.dtype == torch.float32
    assert float(scaled) == 25.0 and p.tolist() == [1.0, 2.0, 3.0, 4.0]
    opt = LossScaleOptimizer(torch.optim.SGD([p], lr=0.5), initial_scale=2.0,
                             dynamic_growth_steps=2)  # fmt: skip
    for _ in range(8):
        opt.apply([torch.tensor([1.0, 6.0, 7.0, 2.0])], [p])
    assert float(opt.scale_loss(1.0)) == 32.0 and float(opt.scale_loss(3)) == 96.0
    p.grad = torch.ones(4)  # a number scaled is not a loss scaled: step() still refuses
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    with pytest.raises(TypeError, match="loss must be a tensor or a number"):
        opt.scale_loss("1.0")


def test_a_keras_written_inner_config_with_registered_name_is_read():
    """Keras's serializer writes ``registered_name`` beside ``module``, ``class_name`` and
    ``config``: ``None`` for a built-in class, ``"package>Name"`` for a registered one,
    which ``custom_objects`` may name instead of the class name (as Keras looks it up)."""
    net, opt = make(initial_scale=16.0, name="ls")
    config = json.loads(json.dumps(opt.get_config()))
    config["inner_optimizer"]["registered_name"] = None
    twin = LossScaleOptimizer.from_config(config, params=net.parameters())
    assert twin.inner_optimizer.defaults == opt.inner_optimizer.defaults

    class MySGD(torch.optim.SGD):
        pass

    custom = LossScaleOptimizer(MySGD(net.parameters(), lr=0.3)).get_config()
    custom["inner_optimizer"]["registered_name"] = "my_package>MySGD"
    rebuilt = LossScaleOptimizer.from_config(
        custom, {"my_package>MySGD": MySGD}, params=net.parameters()
    )
    assert type(rebuilt.inner_optimizer) is MySGD and rebuilt.lr == 0.3
    with pytest.raises(ValueError, match=r"custom_objects=\{'my_package>MySGD': MySGD\}"):
        LossScaleOptimizer.from_config(custom, params=net.parameters())
    custom["inner_optimizer"]["registered_name"] = 7
    with pytest.raises(TypeError, match="registered_name must be a str or None, got 7"):
        LossScaleOptimizer.from_config(custom, {"MySGD": MySGD}, params=net.parameters())
