"""Seed 001: Keras 3 ``LossScaleOptimizer`` and the base-optimizer options.

``mixprec.compat.keras.LossScaleOptimizer(inner_optimizer, initial_scale=32768.0,
dynamic_growth_steps=2000, **kwargs)``: the documented rule (halve and skip on a
non-finite gradient, double after ``dynamic_growth_steps`` finite steps; checked
against ``torch.amp.GradScaler``'s update kernel), and every base-optimizer keyword
argument, each checked against the formula the document gives for it. All options act
on unscaled gradients: the tests go through the scaled loss to show it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.compat import keras

INF, NAN = float("inf"), float("nan")


def _params():
    return [nn.Parameter(torch.tensor([1.0, -2.0])), nn.Parameter(torch.tensor([0.5, 0.25, 3.0]))]


def _step(opt, params, grads):
    """One Keras-style train step: the gradients of ``scale_loss(loss)``, then ``apply``,
    with ``loss = sum(<g, p>)`` so that the true gradient of each parameter is ``g``."""
    loss = sum((g * p).sum() for g, p in zip(grads, params))
    scaled = torch.autograd.grad(opt.scale_loss(loss), params)
    opt.apply(scaled, params)


GRADS = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.1, -0.2])]


def test_signature_and_defaults():
    params = inspect.signature(keras.LossScaleOptimizer).parameters
    assert list(params) == ["inner_optimizer", "initial_scale", "dynamic_growth_steps", "kwargs"]
    assert params["initial_scale"].default == 32768.0
    assert params["dynamic_growth_steps"].default == 2000
    opt = keras.LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1))
    assert opt.initial_scale == 32768.0 and float(opt.dynamic_scale) == 32768.0
    assert opt.dynamic_growth_steps == 2000
    assert int(opt.step_counter) == 0 and int(opt.iterations) == 0
    assert opt.name == "loss_scale_optimizer"
    # Base-optimizer defaults: use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None.
    assert opt.use_ema is False and opt.ema_momentum == 0.99
    assert opt.ema_overwrite_frequency is None
    for name in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
        assert getattr(opt, name) is None, name
    assert opt.gradient_accumulation_steps is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "my_opt"},
        {"weight_decay": 0.004},
        {"clipnorm": 1.0},
        {"clipvalue": 0.5},
        {"global_clipnorm": 2.0},
        {"use_ema": True},
        {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 5},
        {"loss_scale_factor": 8.0},
        {"gradient_accumulation_steps": 4},
    ],
)
def test_each_base_optimizer_kwarg_is_accepted_and_readable(kwargs):
    opt = keras.LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), **kwargs)
    for key, value in kwargs.items():
        assert getattr(opt, key) == value, key


def test_every_documented_kwarg_is_listed():
    documented = {
        "name",
        "weight_decay",
        "clipnorm",
        "clipvalue",
        "global_clipnorm",
        "use_ema",
        "ema_momentum",
        "ema_overwrite_frequency",
        "loss_scale_factor",
        "gradient_accumulation_steps",
    }
    assert set(keras.BASE_OPTIMIZER_KWARGS) == documented


def test_unknown_kwarg_is_a_type_error():
    with pytest.raises(TypeError, match="learning_rat"):
        keras.LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), learning_rat=0.1)


@pytest.mark.parametrize(
    "kwargs", [{"initial_scale": 0.0}, {"initial_scale": -1.0}, {"dynamic_growth_steps": 0}]
)
def test_bad_scale_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        keras.LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), **kwargs)


def test_scale_loss_multiplies_by_the_dynamic_scale():
    opt = keras.LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), initial_scale=1024.0)
    assert opt.scale_loss(torch.tensor(0.75)).item() == 768.0


def test_apply_unscales_scaled_gradients_and_steps():
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1))
    start = [p.detach().clone() for p in params]
    _step(opt, params, GRADS)
    for p, p0, g in zip(params, start, GRADS):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g)
    assert int(opt.iterations) == 1 and int(opt.step_counter) == 1


def test_rule_matches_gradscaler_reference_including_below_one():
    """Halve on a non-finite gradient (skip the step), double after dynamic_growth_steps
    finite steps. Keras 3 sets no floor: the scale may go below 1, as GradScaler's."""
    params = _params()
    opt = keras.LossScaleOptimizer(
        torch.optim.SGD(params, lr=0.1), initial_scale=2.0, dynamic_growth_steps=2
    )
    ref_scale, ref_tracker = torch.tensor(2.0), torch.zeros((), dtype=torch.int32)
    pattern = [0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1]
    scales = []
    for overflow in pattern:
        before = [p.detach().clone() for p in params]
        grads = [torch.full_like(p, NAN if overflow else 0.5) for p in params]
        opt.apply(grads, params)
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor(float(overflow)), 2.0, 0.5, 2)
        assert float(opt.dynamic_scale) == float(ref_scale)
        assert int(opt.step_counter) == int(ref_tracker)
        scales.append(float(opt.dynamic_scale))
        unchanged = all(torch.equal(a, b) for a, b in zip(before, params))
        assert unchanged == bool(overflow)  # "the train step is skipped"
    assert min(scales) == 0.25  # went below 1: no floor
    assert int(opt.iterations) == pattern.count(0)


def test_step_pytorch_style_uses_the_same_rule():
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1), dynamic_growth_steps=1)
    opt.scale_loss(sum(p.sum() for p in params)).backward()
    opt.step()
    opt.zero_grad()
    assert float(opt.dynamic_scale) == 65536.0  # one finite step of a period of 1: doubled
    opt.scale_loss(params[0].sum() * INF).backward()
    opt.step()
    assert float(opt.dynamic_scale) == 32768.0


def test_name():
    opt = keras.LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), name="ls_sgd")
    assert opt.name == "ls_sgd"


def test_weight_decay_is_decoupled_and_applied_before_the_step():
    """'If set, weight decay is applied': Keras's p <- p - p * weight_decay * lr, then the
    inner update."""
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1), weight_decay=0.5)
    start = [p.detach().clone() for p in params]
    _step(opt, params, GRADS)
    for p, p0, g in zip(params, start, GRADS):
        torch.testing.assert_close(p.detach(), p0 * (1 - 0.1 * 0.5) - 0.1 * g)


def test_weight_decay_is_the_wrappers_not_the_inner_optimizers():
    inner = torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.3)
    opt = keras.LossScaleOptimizer(inner, weight_decay=0.1)
    assert opt.weight_decay == 0.1 and inner.param_groups[0]["weight_decay"] == 0.3


def test_clipnorm_clips_each_gradient_norm_separately():
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=1.0), clipnorm=1.0)
    start = [p.detach().clone() for p in params]
    _step(opt, params, GRADS)  # norms 5 (clipped to 1) and 0.224 (kept)
    torch.testing.assert_close(params[0].detach(), start[0] - GRADS[0] / 5.0)
    torch.testing.assert_close(params[1].detach(), start[1] - GRADS[1])


def test_clipvalue_clips_each_element():
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=1.0), clipvalue=0.15)
    start = [p.detach().clone() for p in params]
    _step(opt, params, GRADS)
    for p, p0, g in zip(params, start, GRADS):
        torch.testing.assert_close(p.detach(), p0 - g.clamp(-0.15, 0.15))


def test_global_clipnorm_clips_the_joint_norm():
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=1.0), global_clipnorm=1.0)
    start = [p.detach().clone() for p in params]
    _step(opt, params, GRADS)
    total = torch.cat(GRADS).norm()
    for p, p0, g in zip(params, start, GRADS):
        torch.testing.assert_close(p.detach(), p0 - g / total)


def _keras_ema_reference(start, grads_seq, lr, momentum, overwrite_frequency):
    """Keras's formula: the average starts as the variable after the first step, then
    new_average = ema_momentum * old_average + (1 - ema_momentum) * current_value; every
    ema_overwrite_frequency iterations the variable is overwritten by its average."""
    var, avg = start.clone(), None
    for i, g in enumerate(grads_seq):
        var = var - lr * g
        avg = var.clone() if avg is None else momentum * avg + (1 - momentum) * var
        if overwrite_frequency and (i + 1) % overwrite_frequency == 0:
            var = avg.clone()
    return var, avg


@pytest.mark.parametrize("overwrite_frequency", [None, 3])
def test_use_ema_follows_the_documented_formula(overwrite_frequency):
    p = nn.Parameter(torch.tensor([1.0, -1.0]))
    opt = keras.LossScaleOptimizer(
        torch.optim.SGD([p], lr=0.1),
        use_ema=True,
        ema_momentum=0.5,
        ema_overwrite_frequency=overwrite_frequency,
    )
    grads_seq = [torch.tensor([1.0, 2.0]) * (k + 1) for k in range(5)]
    start = p.detach().clone()
    for g in grads_seq:
        _step(opt, [p], [g])
    var, avg = _keras_ema_reference(start, grads_seq, 0.1, 0.5, overwrite_frequency)
    torch.testing.assert_close(p.detach(), var)
    # Without an overwrite frequency the variables follow the plain updates, and
    # finalize_variable_values() writes the averages in at the end of training.
    opt.finalize_variable_values()
    torch.testing.assert_close(p.detach(), avg)


def test_ema_ignores_skipped_steps():
    p = nn.Parameter(torch.tensor([1.0]))
    opt = keras.LossScaleOptimizer(torch.optim.SGD([p], lr=0.1), use_ema=True, ema_momentum=0.5)
    _step(opt, [p], [torch.tensor([1.0])])  # p = 0.9, average = 0.9
    opt.apply([torch.tensor([INF])], [p])  # skipped: nothing moves
    _step(opt, [p], [torch.tensor([1.0])])  # p = 0.8, average = 0.85
    opt.finalize_variable_values()
    torch.testing.assert_close(p.detach(), torch.tensor([0.85]))


def test_loss_scale_factor_scales_the_loss_and_not_the_update():
    """'the scale factor will be multiplied the loss before computing gradients, and the
    inverse of the scale factor will be multiplied by the gradients'."""
    params = _params()
    opt = keras.LossScaleOptimizer(
        torch.optim.SGD(params, lr=0.1), initial_scale=16.0, loss_scale_factor=4.0
    )
    assert opt.scale_loss(torch.tensor(1.5)).item() == 1.5 * 16.0 * 4.0
    start = [p.detach().clone() for p in params]
    _step(opt, params, GRADS)
    for p, p0, g in zip(params, start, GRADS):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g)


def test_gradient_accumulation_steps_updates_with_the_average():
    params = _params()
    opt = keras.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1), gradient_accumulation_steps=3)
    start = [p.detach().clone() for p in params]
    seq = [[g * k for g in GRADS] for k in (1.0, 2.0, 6.0)]
    for k, grads in enumerate(seq):
        _step(opt, params, grads)
        if k < 2:  # "model & optimizer variables will not be updated at every step"
            assert all(torch.equal(p.detach(), p0) for p, p0 in zip(params, start))
    for i, (p, p0) in enumerate(zip(params, start)):
        mean = sum(grads[i] for grads in seq) / 3  # "using the average value of the gradients"
        torch.testing.assert_close(p.detach(), p0 - 0.1 * mean)


@pytest.mark.parametrize(
    ("name", "compute"), [("mixed_float16", torch.float16), ("mixed_bfloat16", torch.bfloat16)]
)
def test_policy_names(name, compute):
    policy = keras.Policy(name)
    assert policy.param_dtype == torch.float32  # Keras: variable_dtype float32
    assert policy.compute_dtype == compute
    assert str(policy) == name and keras.Policy(str(policy)) == policy


def test_global_mixed_policy_makes_layers_compute_low_with_float32_variables():
    keras.set_global_policy("mixed_bfloat16")
    try:
        assert str(keras.global_policy()) == "mixed_bfloat16"
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        amp.set_policy(net)  # no policy given: the global one
    finally:
        keras.set_global_policy("float32")
    out = net(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16 and net[0].weight.dtype == torch.float32
    with keras.policy_scope("mixed_float16"):
        assert str(keras.global_policy()) == "mixed_float16"
    assert str(keras.global_policy()) == "float32"
