"""Seed 000: TensorFlow 2 ``tf.keras.mixed_precision.LossScaleOptimizer``.

Every example of the document, line by line in PyTorch, through
``mixprec.compat.tf.LossScaleOptimizer``, and the documented behaviour around them:
defaults, attributes, the dynamic rule (checked against ``torch.amp.GradScaler``'s
update kernel), skipped steps on a real float16 model, and hyperparameter delegation.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.compat import tf

INF, NAN = float("inf"), float("nan")


def _var_example():
    """``opt = SGD(0.25); opt = LossScaleOptimizer(opt); var = Variable(1.); loss = var**2``."""
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    return var, opt, (lambda: var**2)


# -- the two examples at the top of the document --------------------------------------


def test_minimize_example_gives_0_5():
    var, opt, loss_fn = _var_example()
    # 'minimize' applies loss scaling and updates the loss scale.
    opt.minimize(loss_fn, var_list=var)
    assert var.item() == 0.5
    assert int(opt.iterations) == 1 and int(opt.dynamic_counter) == 1
    assert float(opt.loss_scale) == 2.0**15  # finite gradient: scale unchanged


def test_gradient_tape_example_gives_0_25():
    var, opt, loss_fn = _var_example()
    opt.minimize(loss_fn, var_list=var)
    # with tf.GradientTape() as tape: loss = loss_fn(); scaled_loss = opt.get_scaled_loss(loss)
    loss = loss_fn()
    scaled_loss = opt.get_scaled_loss(loss)
    assert scaled_loss.item() == 0.25 * 2.0**15  # var is 0.5: loss 0.25, times the scale
    # scaled_grad = tape.gradient(scaled_loss, var)
    (scaled_grad,) = torch.autograd.grad(scaled_loss, [var])
    assert scaled_grad.item() == 2 * 0.5 * 2.0**15
    (grad,) = opt.get_unscaled_gradients([scaled_grad])
    assert grad.item() == 1.0
    opt.apply_gradients([(grad, var)])  # Loss scale is updated here
    assert var.item() == 0.25
    assert int(opt.dynamic_counter) == 2 and int(opt.iterations) == 2


# -- constructor, defaults and attributes ---------------------------------------------


def test_constructor_signature_and_defaults():
    params = inspect.signature(tf.LossScaleOptimizer).parameters
    assert list(params) == ["inner_optimizer", "dynamic", "initial_scale", "dynamic_growth_steps"]
    assert params["dynamic"].default is True
    assert params["initial_scale"].default is None
    assert params["dynamic_growth_steps"].default is None

    var, opt, _ = _var_example()
    assert opt.dynamic is True
    assert opt.initial_scale == 2.0**15  # "If dynamic is True, this defaults to 2 ** 15"
    assert opt.dynamic_growth_steps == 2000  # "Defaults to 2000"
    assert isinstance(opt.dynamic_counter, torch.Tensor) and int(opt.dynamic_counter) == 0
    assert isinstance(opt.inner_optimizer, torch.optim.SGD)
    # "loss_scale: The current loss scale as a float32 scalar tensor."
    assert opt.loss_scale.dtype == torch.float32 and opt.loss_scale.shape == ()
    assert float(opt.loss_scale) == 2.0**15


def test_fixed_loss_scale_attributes():
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.25), dynamic=False, initial_scale=128)
    assert opt.dynamic is False
    assert opt.dynamic_counter is None  # "This is None if LossScaleOptimizer.dynamic is False."
    assert opt.dynamic_growth_steps is None
    # "If dynamic is False, this is the same number as loss_scale, as it never changes."
    assert opt.initial_scale == float(opt.loss_scale) == 128.0
    for _ in range(3):
        opt.minimize(lambda: var**2, var_list=[var])
    assert float(opt.loss_scale) == 128.0 and opt.dynamic_counter is None
    opt.apply_gradients([(torch.tensor(INF), var)])  # skipped, but the scale stays
    assert float(opt.loss_scale) == 128.0


def test_dynamic_false_requires_initial_scale():
    var = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(ValueError, match="initial_scale"):
        tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.1), dynamic=False)


def test_dynamic_growth_steps_only_with_dynamic_true():
    var = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        tf.LossScaleOptimizer(
            torch.optim.SGD([var], lr=0.1), dynamic=False, initial_scale=8, dynamic_growth_steps=10
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_scale": 0},
        {"initial_scale": -1.0},
        {"initial_scale": INF},
        {"dynamic_growth_steps": 0},
        {"dynamic_growth_steps": -5},
        {"dynamic": False, "initial_scale": -2.0},
    ],
)
def test_invalid_arguments_raise_value_error(kwargs):
    var = torch.tensor(1.0, requires_grad=True)
    inner = torch.optim.SGD([var], lr=0.1)
    with pytest.raises(ValueError):
        tf.LossScaleOptimizer(inner, **kwargs)


def test_inner_optimizer_must_be_a_plain_torch_optimizer():
    var = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(TypeError):
        tf.LossScaleOptimizer("sgd")
    wrapped = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.1))
    with pytest.raises((TypeError, ValueError), match="LossScaleOptimizer"):
        tf.LossScaleOptimizer(wrapped)  # cannot wrap another LossScaleOptimizer


def test_custom_initial_scale_and_growth_steps():
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(
        torch.optim.SGD([var], lr=0.0), initial_scale=2.0**30, dynamic_growth_steps=3
    )
    # No ceiling at 2**24 in TensorFlow's rule: a high initial scale is kept as given.
    assert float(opt.loss_scale) == 2.0**30 and opt.dynamic_growth_steps == 3
    for _ in range(3):
        opt.minimize(lambda: var**2, var_list=[var])
    assert float(opt.loss_scale) == 2.0**31


# -- the dynamic rule -----------------------------------------------------------------


def test_dynamic_counter_and_scale_match_gradscaler_reference():
    """Counter +1 per finite step; at dynamic_growth_steps the scale doubles and the
    counter resets; a non-finite gradient halves the scale and resets the counter.
    Reference: the update kernel of ``torch.amp.GradScaler``."""
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.01), dynamic_growth_steps=3)
    ref_scale = torch.tensor(2.0**15)
    ref_tracker = torch.zeros((), dtype=torch.int32)
    pattern = [0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    for overflow in pattern:
        before = var.detach().clone()
        opt.apply_gradients([(torch.tensor(INF if overflow else 0.5), var)])
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor(float(overflow)), 2.0, 0.5, 3)
        assert float(opt.loss_scale) == float(ref_scale)
        assert int(opt.dynamic_counter) == int(ref_tracker)
        assert torch.equal(var.detach(), before) == bool(overflow)  # skipped iff non-finite
    assert int(opt.iterations) == pattern.count(0)
    assert int(opt.skipped_steps) == pattern.count(1)


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_nonfinite_gradient_skips_halves_and_resets(bad):
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    opt.minimize(lambda: var**2, var_list=[var])
    opt.minimize(lambda: var**2, var_list=[var])
    assert int(opt.dynamic_counter) == 2
    value = var.item()
    opt.apply_gradients([(torch.tensor(bad), var)])
    assert var.item() == value  # "the trainable variables will not change that step"
    assert float(opt.loss_scale) == 2.0**14
    assert int(opt.dynamic_counter) == 0
    assert int(opt.iterations) == 2  # counts applied steps only
    assert bool(opt.last_step_skipped)


def test_minimize_also_skips_on_overflow():
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    # d/dvar of var * 1e35 is 1e35; times 2**15 it overflows float32.
    opt.minimize(lambda: var * 1e35, var_list=[var])
    assert var.item() == 1.0 and float(opt.loss_scale) == 2.0**14
    opt.minimize(lambda: var**2, var_list=[var])
    assert var.item() == 0.5


def _float16_regression(seed: int = 0):
    """A real float16 model: an MLP under the mixed_float16 policy (float32 variables,
    float16 compute), fit full-batch to unnormalised targets (about 40), so that the
    loss gradients times 2**15 overflow float16's 65504 inside the backward pass."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=gen)
    y = x @ torch.randn(16, 1, generator=gen) + 40.0
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    amp.set_policy(net, "mixed_float16")
    assert net(x).dtype == torch.float16 and net[0].weight.dtype == torch.float32

    def loss_fn():
        return nn.functional.mse_loss(net(x).float(), y)

    return net, loss_fn


def _halvings_until_finite(net, loss_fn) -> int:
    """Reference: how many halvings of 2**15 the float16 gradients need to be finite."""
    for k in range(40):
        grads = torch.autograd.grad(loss_fn() * 2.0 ** (15 - k), list(net.parameters()))
        if all(torch.isfinite(g).all() for g in grads):
            return k
    raise AssertionError("gradients never became finite")


def test_first_2_to_15_steps_are_skipped_on_a_float16_model():
    """'Typically, the first 2 to 15 steps of the model are skipped as the initial loss
    scale is very high, but afterwards steps will only be skipped on average 0.05% of
    the time.' Measured with the default initial scale (2**15)."""
    net, loss_fn = _float16_regression()
    expected = _halvings_until_finite(net, loss_fn)
    opt = tf.LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3))
    skipped, losses = [], []
    for _ in range(40):
        before = [p.detach().clone() for p in net.parameters()]
        losses.append(opt.minimize(loss_fn, var_list=list(net.parameters())).item())
        skipped.append(bool(opt.last_step_skipped))
        unchanged = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        assert unchanged == skipped[-1]
    count = sum(skipped)
    print(f"\nfloat16 model, initial scale 2**15: first {count} steps skipped")
    assert 2 <= count <= 15
    assert count == expected
    assert skipped == [True] * count + [False] * (40 - count)  # only the first ones
    assert float(opt.loss_scale) == 2.0 ** (15 - count)
    assert int(opt.iterations) == 40 - count and int(opt.skipped_steps) == count
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.7 * losses[0]


def test_afterwards_one_skip_per_growth_period_on_a_float16_model():
    """'the fraction of steps skipped is 1 / dynamic_growth_steps': once the scale has
    settled, every dynamic_growth_steps finite steps it doubles into overflow once.
    The model is frozen (lr=0) so that its gradients stay at their settled size."""
    net, loss_fn = _float16_regression()
    growth = 10
    opt = tf.LossScaleOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.0), dynamic_growth_steps=growth
    )
    warmup = _halvings_until_finite(net, loss_fn)
    for _ in range(warmup):
        opt.minimize(loss_fn, var_list=list(net.parameters()))
    assert int(opt.skipped_steps) == warmup
    cycles = 3
    for _ in range(cycles * (growth + 1)):
        opt.minimize(loss_fn, var_list=list(net.parameters()))
    assert int(opt.skipped_steps) - warmup == cycles  # 1 in growth + 1 steps
    assert float(opt.loss_scale) == 2.0 ** (15 - warmup)


def test_default_growth_steps_skip_about_0_05_percent():
    """The same settled regime with the default dynamic_growth_steps=2000, on the loss
    scale that the optimizer uses (one float16 gradient of fixed size per step)."""
    scale = tf.DynamicLossScale()  # TensorFlow's rule with the optimizer's defaults
    grad16 = torch.tensor(3.0, dtype=torch.float16)  # overflows at 2**15, fine at 2**14
    skipped = 0
    steps = 3 * 2001 + 1
    for _ in range(steps):
        scaled = grad16 * scale().to(torch.float16)
        skipped += not bool(scale.update([scaled]))
    assert skipped == 1 + 3  # the warm-up skip, then one per 2001 steps
    assert (skipped - 1) / (steps - 1) == pytest.approx(1 / 2001)
    assert 100 * (skipped - 1) / (steps - 1) == pytest.approx(0.05, abs=0.001)


# -- hyperparameters ------------------------------------------------------------------


def test_hyperparameter_delegation_beta_1():
    var = torch.tensor(1.0, requires_grad=True)
    # opt = tf.keras.optimizers.Adam(beta_1=0.8, epsilon=1e-5): PyTorch spells beta_1 betas[0]
    opt = torch.optim.Adam([var], betas=(0.8, 0.999), eps=1e-5)
    opt = tf.LossScaleOptimizer(opt)
    assert opt.betas[0] == 0.8  # Equivalent to opt.inner_optimizer.beta_1
    opt.betas = (0.7, 0.999)  # Equivalent to opt.inner_optimizer.beta_1 = 0.7
    assert opt.betas[0] == 0.7
    assert opt.inner_optimizer.param_groups[0]["betas"][0] == 0.7
    assert opt.lr == 1e-3 and opt.inner_optimizer.defaults["lr"] == 1e-3


def test_non_hyperparameters_are_not_delegated_epsilon_counter_example():
    var = torch.tensor(1.0, requires_grad=True)
    inner = torch.optim.Adam([var], betas=(0.8, 0.999), eps=1e-5)
    inner.epsilon = 1e-5  # a plain attribute, which is what Keras's Adam.epsilon is
    opt = tf.LossScaleOptimizer(inner)
    assert opt.inner_optimizer.epsilon == 1e-5
    with pytest.raises(
        AttributeError, match=r"^'LossScaleOptimizer' object has no attribute 'epsilon'$"
    ):
        opt.epsilon  # noqa: B018
    opt.epsilon = 1e-4  # This does NOT set epsilon on opt.inner_optimizer
    assert opt.inner_optimizer.epsilon == 1e-5
    assert opt.epsilon == 1e-4


def test_eps_is_a_hyperparameter_in_pytorch_and_is_delegated():
    """Deliberate difference: torch's Adam keeps eps in its param groups (a
    hyperparameter), so setting it on the wrapper changes training, unlike Keras."""
    a = torch.tensor([1.0, -2.0], requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    opt = tf.LossScaleOptimizer(torch.optim.Adam([a], lr=0.1, eps=1e-5))
    assert opt.eps == 1e-5
    opt.eps = 10.0  # large, so that it visibly changes the step
    assert opt.inner_optimizer.param_groups[0]["eps"] == 10.0
    ref = torch.optim.Adam([b], lr=0.1, eps=10.0)
    opt.minimize(lambda: (a**2).sum(), var_list=[a])
    (b**2).sum().backward()
    ref.step()
    torch.testing.assert_close(a, b)


# -- get_scaled_loss / get_unscaled_gradients ------------------------------------------


def test_get_scaled_loss_takes_a_tensor_or_a_callable():
    var, opt, _ = _var_example()
    assert opt.get_scaled_loss(torch.tensor(3.0)).item() == 3.0 * 2**15
    scaled = opt.get_scaled_loss(lambda: torch.tensor(3.0))
    assert callable(scaled)  # a callable in, a callable out (TF's behaviour)
    assert scaled().item() == 3.0 * 2**15


def test_get_unscaled_gradients_keeps_none_and_returns_a_new_list():
    var, opt, _ = _var_example()
    grads = [torch.tensor([2.0**15, 2.0**16]), None, torch.tensor(-(2.0**14))]
    out = opt.get_unscaled_gradients(grads)
    assert out is not grads and len(out) == 3 and out[1] is None
    torch.testing.assert_close(out[0], torch.tensor([1.0, 2.0]))
    assert out[2].item() == -0.5
    assert grads[0].tolist() == [2.0**15, 2.0**16]  # the inputs are left alone


# -- delegation of the Optimizer interface --------------------------------------------


def test_public_optimizer_methods_reach_the_inner_optimizer():
    w = nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([w], lr=0.5, momentum=0.9)
    opt = tf.LossScaleOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    opt.scale_loss(w.sum()).backward()
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert "momentum_buffer" in inner.state[w]  # the inner step ran
    opt.zero_grad()
    assert w.grad is None
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra]})
    assert inner.param_groups[-1]["params"] == [extra]
    assert opt.state_dict()["param_groups"] == inner.state_dict()["param_groups"]
