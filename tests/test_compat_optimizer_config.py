"""The nested inner-optimizer config of the compat optimizers: every torch optimizer
round-trips to the same class and hyperparameters, per parameter group (through the TF
``LossScaleOptimizer``'s ``get_config``/``from_config``; the Keras one writes the same)."""

import json

import pytest
import torch

from mixprec.compat import tf


def optimizer_config(opt: torch.optim.Optimizer) -> dict:
    """``opt`` as the compat optimizers' configs nest it (``inner_optimizer``)."""
    return tf.LossScaleOptimizer(opt).get_config()["inner_optimizer"]


def optimizer_from_config(config, params, custom_objects=None) -> torch.optim.Optimizer:
    """The inner optimizer that ``from_config`` rebuilds from ``config`` over ``params``."""
    wrapper = tf.LossScaleOptimizer.from_config(
        {"inner_optimizer": config}, custom_objects, params=params
    )
    return wrapper.inner_optimizer

TORCH_OPTIMIZERS = sorted(
    name
    for name in dir(torch.optim)
    if isinstance(getattr(torch.optim, name), type)
    and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    and getattr(torch.optim, name) is not torch.optim.Optimizer
)


def params(n=2):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(n)]


def hyper(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def build(name, ps):
    cls = getattr(torch.optim, name)
    try:
        return cls(ps)
    except TypeError:  # no default learning rate
        return cls(ps, lr=0.05)


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_every_torch_optimizer_round_trips_through_json(name):
    opt = build(name, params())
    config = optimizer_config(opt)
    assert config["class_name"] == name and "param_groups" not in config
    again = optimizer_from_config(json.loads(json.dumps(config)), params())
    assert type(again) is type(opt)
    assert again.defaults == opt.defaults and hyper(again) == hyper(opt)


def test_groups_that_differ_are_saved_per_group_and_need_as_many_groups_back():
    a, b = params()
    opt = torch.optim.AdamW(
        [{"params": [a]}, {"params": [b], "lr": 0.01}], lr=0.1, betas=(0.8, 0.9)
    )
    config = optimizer_config(opt)
    assert config["config"]["lr"] == 0.1  # the groups disagree: the constructor's value
    assert config["param_groups"] == [{}, {"lr": 0.01}]
    assert "decoupled_weight_decay" not in config["config"]  # AdamW's own, not an argument
    again = optimizer_from_config(config, [{"params": [a]}, {"params": [b]}])
    assert hyper(again) == hyper(opt)
    with pytest.raises(ValueError, match="2 parameter groups, but params gives 1"):
        optimizer_from_config(config, [a, b])
    mine = optimizer_from_config(config, [{"params": [a], "lr": 0.5}, {"params": [b]}])
    assert mine.param_groups[0]["lr"] == 0.5  # a value given with the params wins


def test_the_config_holds_the_learning_rate_of_now():
    opt = torch.optim.SGD(params(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    scheduler.step()
    assert optimizer_config(opt)["config"]["lr"] == 0.5


def test_classes_come_from_torch_optim_or_custom_objects_only():
    opt = torch.optim.SGD(params(), lr=0.1)
    config = optimizer_config(opt)
    with pytest.raises(ValueError, match="params=model.parameters"):
        optimizer_from_config(config, None)
    evil = dict(config, module="os", class_name="system")
    with pytest.raises(ValueError, match="unknown optimizer class 'system'"):
        optimizer_from_config(evil, params())
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer subclass"):
        optimizer_from_config(config, params(), custom_objects={"SGD": dict})
    with pytest.raises(ValueError, match="unknown keys"):
        optimizer_from_config(dict(config, extra=1), params())
    with pytest.raises(ValueError, match="'class_name' and 'config'"):
        optimizer_from_config({"config": {}}, params())
    with pytest.raises(TypeError, match="params must be an iterable"):
        optimizer_from_config(config, 3)


@pytest.mark.parametrize("registered_name", [None, "SGD"])
def test_keras_serializers_registered_name_is_read(registered_name):
    """Keras's ``serialize_keras_object`` adds ``registered_name`` to every config it
    writes; the key is read (and resolved through ``custom_objects`` first, as Keras
    does), while other unknown keys stay refused."""
    opt = torch.optim.SGD(params(), lr=0.1, momentum=0.9)
    config = dict(optimizer_config(opt), registered_name=registered_name)
    again = optimizer_from_config(json.loads(json.dumps(config)), params())
    assert type(again) is torch.optim.SGD and hyper(again) == hyper(opt)
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        optimizer_from_config(dict(config, extra=1), params())
    keras_sgd = {"module": "keras.optimizers", "class_name": "SGD", "registered_name": None,
                 "config": {"name": "SGD", "learning_rate": 0.01, "momentum": 0.0}}  # fmt: skip
    with pytest.raises(ValueError, match=r"a Keras optimizer's \(keras.optimizers.SGD\).*torch"):
        optimizer_from_config(keras_sgd, params())
