"""TensorFlow's own loss-scale and LossScaleOptimizer tests, re-expressed against
``mixprec.compat.tf``: the numbers, keys, reprs and errors TensorFlow's suite expects
(``training/experimental/loss_scale_test.py``, ``keras/mixed_precision/
loss_scale_optimizer_test.py``), and the deliberate differences documented in
docs/seeds.md."""

import json

import numpy as np
import pytest
import torch

from mixprec.compat.tf import (
    DynamicLossScale,
    FixedLossScale,
    LossScaleOptimizer,
    enable_mixed_precision_graph_rewrite,
)

F32_MAX = float(np.finfo(np.float32).max)


# -- loss_scale_test.py -----------------------------------------------------------------


def test_fixed_loss_scale_repr_and_serialization():
    assert repr(FixedLossScale(123)) == "FixedLossScale(123.0)"
    config = FixedLossScale(123).get_config()
    assert config == {"loss_scale_value": 123.0}
    assert float(FixedLossScale.from_config(config)()) == 123.0
    assert isinstance(FixedLossScale(123)(), torch.Tensor)


def test_dynamic_loss_scale_repr_is_the_eager_one_and_follows_the_state():
    ls = DynamicLossScale(initial_loss_scale=1, increment_period=2, multiplier=3)
    assert repr(ls) == (
        "DynamicLossScale(current_loss_scale=1.0, num_good_steps=0, initial_loss_scale=1.0, "
        "increment_period=2, multiplier=3.0)"
    )
    ls.update([torch.tensor(1.0)])
    assert repr(ls).startswith("DynamicLossScale(current_loss_scale=1.0, num_good_steps=1,")
    ls.update([torch.tensor(1.0)])
    assert repr(ls).startswith("DynamicLossScale(current_loss_scale=3.0, num_good_steps=0,")


def test_dynamic_loss_scale_serialization():
    ls = DynamicLossScale.from_config(
        DynamicLossScale(initial_loss_scale=1, increment_period=2, multiplier=3).get_config()
    )
    assert (float(ls()), ls.increment_period, ls.multiplier) == (1.0, 2, 3.0)


# (inputs: gradients finite?, expected scale after each update, initial, period, multiplier)
TF_DYNAMIC_CASES = {
    "increase": ([True] * 6, [1, 2, 2, 4, 4, 8], 1.0, 2, 2.0),
    "keep_increasing_until_capped": (
        [True] * 6,
        [F32_MAX / 4, F32_MAX / 2, F32_MAX / 2, F32_MAX, F32_MAX, F32_MAX],
        F32_MAX / 4, 2, 2.0,
    ),
    "decrease_every_step": ([False] * 6, [512, 256, 128, 64, 32, 16], 1024.0, 2, 2.0),
    "keep_decreasing_until_one": ([False] * 6, [8, 4, 2, 1, 1, 1], 16.0, 2, 2.0),
    "nan_clear_good_step": ([True, True, True, False, True], [1, 2, 2, 1, 1], 1.0, 2, 2.0),
    "trigger_each_step": ([True] * 3 + [False, True, True], [2, 4, 8, 4, 8, 16], 1.0, 1, 2.0),
    "alternating_each_step": ([True, False] * 4 + [True], [2, 1] * 4 + [2], 1.0, 1, 2.0),
    "alternating_every_other_step": (
        [True, False] * 3 + [True], [32, 16, 16, 8, 8, 4, 4], 32.0, 2, 2.0,
    ),
    "nondefault_multiplier": ([True, True, False, True, True], [4, 12, 4, 4, 12], 4.0, 2, 3.0),
    "random_mix": (
        [False, True, True, True, False, True, False, True, True, True, False],
        [2, 2, 4, 4, 2, 2, 1, 1, 2, 2, 1], 4.0, 2, 2.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TF_DYNAMIC_CASES))
def test_dynamic_loss_scale_gives_tensorflows_numbers(case):
    inputs, expected, initial, period, multiplier = TF_DYNAMIC_CASES[case]
    ls = DynamicLossScale(initial, period, multiplier)
    outputs = []
    for finite in inputs:
        should_apply = ls.update([torch.tensor(1.0 if finite else float("nan"))])
        assert bool(should_apply) == finite
        outputs.append(float(ls()))
    assert outputs == [float(np.float32(e)) for e in expected]


def test_single_tensor_and_none_gradients():
    ls = DynamicLossScale()
    assert bool(ls.update(torch.tensor(4.0)))
    assert bool(ls.update([None]))


def test_fixed_loss_scale_update_on_nan_is_a_deliberate_difference():
    """TF's FixedLossScale.update returns should_apply=True even for a NaN gradient (the
    step is then applied with NaN). mixprec optimizers skip non-finite steps with every
    kind of loss scale, so the flag says what they do: False. The scale never moves."""
    ls = FixedLossScale(1000)
    assert bool(ls.update([torch.tensor(0.0)])) is True
    assert bool(ls.update([torch.tensor(float("nan"))])) is False  # TF: True
    assert float(ls()) == 1000.0
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer._with_loss_scale(torch.optim.SGD([w], lr=1.0), ls)
    opt.apply_gradients([(torch.tensor([float("nan"), 1.0]), w)])
    assert torch.equal(w.detach(), torch.ones(2))  # skipped, not applied with NaN


# -- loss_scale_optimizer_test.py -------------------------------------------------------


def sgd(lr=2.0, momentum=0.5):
    var = torch.nn.Parameter(torch.tensor([5.0]))
    return var, torch.optim.SGD([var], lr=lr, momentum=momentum)


def run_once(opt, var):
    """The test's ``_run_fn_with_grad_check``: loss = var, one minimize step."""
    opt.minimize(lambda: var.sum(), var_list=[var])


def tf23_config(loss_scale):
    """TF 2.3's config: ``optimizer`` and ``loss_scale``, the loss scale serialized as
    ``{"class_name": ..., "config": ...}``."""
    var, inner = sgd()
    legacy = LossScaleOptimizer(inner).get_config()["inner_optimizer"]
    serialized = {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}
    return {"optimizer": legacy, "loss_scale": serialized}, var


@pytest.mark.parametrize("source", ["v2", "tf2_3"])
def test_get_config_fixed(source):
    if source == "v2":
        var, inner = sgd()
        config = LossScaleOptimizer(inner, dynamic=False, initial_scale=2).get_config()
        assert set(config) == {
            "inner_optimizer",
            "dynamic",
            "initial_scale",
            "dynamic_growth_steps",
        }
    else:
        config, var = tf23_config(FixedLossScale(2.0))
    opt = LossScaleOptimizer.from_config(config, params=[var])
    assert opt.lr == 2.0 and opt.inner_optimizer.param_groups[0]["lr"] == 2.0
    assert opt.momentum == 0.5 and float(opt.loss_scale) == 2.0 and opt.initial_scale == 2.0
    assert opt.dynamic_growth_steps is None and opt.dynamic_counter is None and not opt.dynamic
    run_once(opt, var)
    assert var.tolist() == [3.0]


@pytest.mark.parametrize("source", ["v2", "tf2_3"])
def test_get_config_dynamic(source):
    if source == "v2":
        var, inner = sgd()
        config = LossScaleOptimizer(inner, initial_scale=2, dynamic_growth_steps=3).get_config()
    else:
        config, var = tf23_config(DynamicLossScale(initial_loss_scale=2.0, increment_period=3))
    opt = LossScaleOptimizer.from_config(config, params=[var])
    assert opt.lr == 2.0 and opt.momentum == 0.5
    assert float(opt.loss_scale) == 2.0 and opt.initial_scale == 2.0
    assert opt.dynamic_growth_steps == 3 and opt.dynamic
    run_once(opt, var)
    assert var.tolist() == [3.0] and int(opt.dynamic_counter) == 1


def test_from_config_with_invalid_multiplier():
    config, var = tf23_config(DynamicLossScale(initial_loss_scale=2.0, increment_period=3,
                                               multiplier=4.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"multiplier is not 2. Got DynamicLossScale: Dynamic"):
        LossScaleOptimizer.from_config(config, params=[var])


def test_serialization_through_json_with_a_builtin_optimizer():
    var, inner = sgd()
    config = json.loads(
        json.dumps(
            LossScaleOptimizer(inner, initial_scale=2.0, dynamic_growth_steps=3).get_config()
        )
    )
    opt = LossScaleOptimizer.from_config(config, params=[var])
    assert opt.lr == 2.0 and opt.inner_optimizer.param_groups[0]["momentum"] == 0.5
    assert float(opt.loss_scale) == 2.0 and opt.dynamic_growth_steps == 3 and opt.dynamic
    assert type(opt) is LossScaleOptimizer
    run_once(opt, var)
    assert var.tolist() == [3.0] and int(opt.dynamic_counter) == 1


class MySGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.my_attribute = 123


def test_serialization_with_a_custom_optimizer():
    var, _ = sgd()
    config = LossScaleOptimizer(MySGD([var], lr=2.0, momentum=0.5), initial_scale=2.0,
                                dynamic_growth_steps=3).get_config()  # fmt: skip
    with pytest.raises(ValueError, match=r"custom_objects=\{'MySGD': MySGD\}"):
        LossScaleOptimizer.from_config(config, params=[var])
    opt = LossScaleOptimizer.from_config(config, {"MySGD": MySGD}, params=[var])
    assert opt.lr == 2.0 and opt.inner_optimizer.param_groups[0]["momentum"] == 0.5
    assert float(opt.loss_scale) == 2.0 and opt.dynamic_growth_steps == 3
    assert opt.inner_optimizer.my_attribute == 123


def test_from_config_takes_an_optimizer_object_or_needs_params():
    var, inner = sgd()
    config = LossScaleOptimizer(inner).get_config()
    with pytest.raises(ValueError, match="params=model.parameters"):
        LossScaleOptimizer.from_config(config)
    config["inner_optimizer"] = inner
    assert LossScaleOptimizer.from_config(config).inner_optimizer is inner
    with pytest.raises(ValueError, match="drop params="):
        LossScaleOptimizer.from_config(config, params=[var])


def test_get_config_refuses_a_loss_scale_tensorflow_cannot_describe():
    var, inner = sgd()
    opt = enable_mixed_precision_graph_rewrite(inner, DynamicLossScale(multiplier=4.0))
    with pytest.raises(ValueError, match="has no TensorFlow 2 config"):
        opt.get_config()


def test_iterations_is_assignable():
    """TF's testIterations sets ``opt.iterations = 7``. (TF also reads it back from the
    inner optimizer; a torch optimizer has no iterations counter.)"""
    var, inner = sgd()
    opt = LossScaleOptimizer(inner, dynamic=False, initial_scale=10.0)
    opt.iterations = 7
    assert int(opt.iterations) == 7
    run_once(opt, var)
    assert int(opt.iterations) == 8


def test_dir_lists_the_delegated_hyperparameters():
    """TF's testDir: the wrapper's own names and the inner hyperparameters. In torch
    ``nesterov`` is a hyperparameter too (TF asserts it is not listed)."""
    names = dir(LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)))
    for name in ("dynamic", "dynamic_counter", "dynamic_growth_steps", "initial_scale",
                 "inner_optimizer", "loss_scale", "lr", "momentum", "nesterov"):  # fmt: skip
        assert name in names, name


def test_errors_for_bad_constructor_arguments():
    with pytest.raises(ValueError, match="dynamic=False needs initial_scale"):
        LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                           dynamic=False)  # fmt: skip
    with pytest.raises(ValueError, match="dynamic_growth_steps=2 can only be set"):
        LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                           dynamic=False, initial_scale=1, dynamic_growth_steps=2)  # fmt: skip
    with pytest.raises(TypeError, match="dynamic must be True or False, got 'dynamic'"):
        LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                           "dynamic")  # fmt: skip


# -- TF 1 contrib's ExponentialUpdateLossScaleManager: a deliberate difference ----------


def contrib_scales(pattern, init, incr_every_n, decr_every_n, incr=2.0, decr=0.5):
    """TF contrib's rule, written out: bad steps are counted since the last change of
    the scale (a finite step resets the good steps only), good steps since the last
    bad step or change."""
    scale, good, bad, out = init, 0, 0, []
    for overflow in pattern:
        if overflow:
            good = 0
            if bad + 1 >= decr_every_n:
                scale, good, bad = max(1.0, scale * decr), 0, 0
            else:
                bad += 1
        elif good + 1 >= incr_every_n:
            scale, good, bad = scale * incr, 0, 0
        else:
            good += 1
        out.append(scale)
    return out


def mixprec_scales(pattern, init, growth_interval, hysteresis):
    from mixprec.loss_scale import DynamicLossScale as CoreDynamic

    ls = CoreDynamic(initial_scale=init, growth_interval=growth_interval,
                     hysteresis=hysteresis, max_scale=None)  # fmt: skip
    out = []
    for overflow in pattern:
        ls.update(torch.tensor(float(overflow)))
        out.append(float(ls.scale))
    return out


def test_hysteresis_counts_consecutive_overflows_unlike_tf_contrib():
    """Both back off after ``n`` overflows in a row. They differ in two places:
    an overflow, a finite step, an overflow backs off in TF contrib (bad steps count
    since the last change of the scale) but not in mixprec (a finite step resets the
    streak: the scale in use works); and once backed off, mixprec backs off again on
    every further overflow in the same streak (as Megatron-LM's hysteresis), where
    contrib waits for ``n`` more."""
    agree = [True, True, False, True, True]
    assert mixprec_scales(agree, 1024.0, 100, 2) == contrib_scales(agree, 1024.0, 100, 2)
    interleaved = [True, False, True]
    assert contrib_scales(interleaved, 1024.0, 100, 2) == [1024.0, 1024.0, 512.0]
    assert mixprec_scales(interleaved, 1024.0, 100, 2) == [1024.0, 1024.0, 1024.0]
    streak = [True, True, True, True]
    assert contrib_scales(streak, 1024.0, 100, 2) == [1024.0, 512.0, 512.0, 256.0]
    assert mixprec_scales(streak, 1024.0, 100, 2) == [1024.0, 512.0, 256.0, 128.0]


# -- optimizer_v2's apply_gradients, minimize and get_gradients ----------------------------


def test_apply_gradients_without_any_gradient_is_a_value_error_and_changes_nothing():
    """optimizer_v2's ``_filter_grads``: no gradient for any variable is a ``ValueError``
    (nothing applied, nothing counted: repeated empty calls never grow the scale); a
    missing gradient for some of them is a warning, and the others are applied."""
    var, inner = sgd(lr=1.0, momentum=0.0)
    other = torch.nn.Parameter(torch.tensor([1.0]))
    inner.add_param_group({"params": [other]})
    opt = LossScaleOptimizer(inner, initial_scale=4.0, dynamic_growth_steps=1)
    for _ in range(3):
        with pytest.raises(ValueError, match="No gradients provided for any variable"):
            opt.apply_gradients([(None, var), (None, other)])
        with pytest.raises(ValueError, match="No gradients provided for any variable"):
            opt.minimize(lambda: torch.ones(()), var_list=[var])  # var is not used
    assert int(opt.iterations) == 0 and int(opt.dynamic_counter) == 0
    assert float(opt.loss_scale) == 4.0 and var.tolist() == [5.0] and other.tolist() == [1.0]
    with pytest.warns(
        UserWarning, match=r"Gradients do not exist for variables \[grads_and_vars\[1\]"
    ):
        opt.apply_gradients([(torch.tensor([2.0]), var), (None, other)])
    assert var.tolist() == [3.0] and other.tolist() == [1.0] and int(opt.iterations) == 1


def test_minimize_of_a_non_scalar_loss_differentiates_its_sum():
    """``tape.gradient`` of a non-scalar target is the gradient of its sum: minimizing
    ``v * 2`` moves every element by ``lr * 2``, exactly as minimizing ``(v * 2).sum()``."""
    v = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    twin = torch.nn.Parameter(v.detach().clone())
    opt = LossScaleOptimizer(torch.optim.SGD([v], lr=0.5))
    reference = LossScaleOptimizer(torch.optim.SGD([twin], lr=0.5))
    loss = opt.minimize(lambda: v * 2.0, var_list=[v])
    reference.minimize(lambda: (twin * 2.0).sum(), var_list=[twin])
    assert v.tolist() == [0.0, 1.0, 2.0] and torch.equal(v, twin)
    assert loss.tolist() == [2.0, 4.0, 6.0]
    assert int(opt.iterations) == 1 and float(opt.loss_scale) == float(reference.loss_scale)


class IdentityWithGradCheck(torch.autograd.Function):
    """``mp_test_util.create_identity_with_grad_check_fn``: the identity, whose backward
    records the gradient it receives (TF asserts it equals the loss scale)."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        IdentityWithGradCheck.seen.append(grad.clone())
        return grad


def test_get_gradients_returns_unscaled_gradients_of_the_scaled_loss():
    """testFixedLossScaleAppliedToLossWithGetGradients: ``get_gradients(loss, params)``
    differentiates the loss times the scale (the backward pass sees 10) and returns the
    gradients divided by it; nothing is applied, and the loss is not marked as scaled for
    a later ``step()``."""
    var = torch.nn.Parameter(torch.tensor([2.0]))
    opt = LossScaleOptimizer(torch.optim.SGD([var], lr=1.0), dynamic=False, initial_scale=10.0)
    IdentityWithGradCheck.seen.clear()
    grads = opt.get_gradients(IdentityWithGradCheck.apply(var), [var])
    assert [g.tolist() for g in IdentityWithGradCheck.seen] == [[10.0]]
    assert isinstance(grads, list) and [g.tolist() for g in grads] == [[1.0]]
    assert var.tolist() == [2.0] and var.grad is None and int(opt.iterations) == 0
    dynamic = LossScaleOptimizer(torch.optim.SGD([var], lr=1.0), initial_scale=2.0**15)
    w = torch.nn.Parameter(torch.tensor([1.0, 3.0]))
    assert dynamic.get_gradients(lambda: (var * w).sum() * 0.5, [var])[0].tolist() == [2.0]
    assert [g.tolist() for g in dynamic.get_gradients(var * 3.0, var)] == [[3.0]]
    with pytest.raises(ValueError, match=r"params\[1\] of shape \(2,\) has `None` for gradient"):
        dynamic.get_gradients(var * 3.0, [var, w])
    var.grad = torch.ones(1)
    with pytest.raises(RuntimeError, match="scale_loss"):
        dynamic.step()
