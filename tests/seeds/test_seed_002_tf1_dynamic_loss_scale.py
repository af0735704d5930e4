"""Seed 002: TensorFlow 1.15 ``tf.train.experimental.DynamicLossScale``.

``mixprec.compat.tf.DynamicLossScale(initial_loss_scale=2**15, increment_period=2000,
multiplier=2.0)``: ``__call__()`` gives the current scale, ``update(grads)`` returns
``should_apply_gradients``; every ``increment_period`` consecutive finite steps the scale
is multiplied by ``multiplier``; a non-finite gradient resets the count and divides the
scale by ``multiplier``. Also ``FixedLossScale(loss_scale_value)`` from the same API.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from mixprec.compat import tf
from mixprec.loss_scale import DynamicLossScale as CoreDynamicLossScale

INF, NAN = float("inf"), float("nan")
FINITE = [torch.tensor([1.0, -2.0]), torch.tensor(0.5)]


def _bad(value: float = INF):
    return [torch.tensor([1.0, value]), torch.tensor(0.5)]


def test_signature_defaults():
    params = inspect.signature(tf.DynamicLossScale).parameters
    assert list(params) == ["initial_loss_scale", "increment_period", "multiplier"]
    assert params["initial_loss_scale"].default == 2**15
    assert params["increment_period"].default == 2000
    assert params["multiplier"].default == 2.0


def test_attributes():
    ls = tf.DynamicLossScale()
    assert (ls.initial_loss_scale, ls.increment_period, ls.multiplier) == (32768.0, 2000, 2.0)
    ls = tf.DynamicLossScale(initial_loss_scale=8.0, increment_period=3, multiplier=4.0)
    assert (ls.initial_loss_scale, ls.increment_period, ls.multiplier) == (8.0, 3, 4.0)


def test_default_is_approximately_half_the_float16_maximum():
    """'The default is 2 ** 15, which is approximately half the maximum float16 value.'"""
    assert tf.DynamicLossScale().initial_loss_scale == pytest.approx(
        torch.finfo(torch.float16).max / 2, rel=1e-3
    )


def test_call_returns_the_current_scale_as_float32_scalar_tensor():
    ls = tf.DynamicLossScale(initial_loss_scale=64.0)
    value = ls()
    assert isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.shape == ()
    assert value.item() == 64.0
    ls.update(_bad())
    assert ls().item() == 32.0


def test_update_returns_should_apply_gradients():
    ls = tf.DynamicLossScale()
    ok = ls.update(FINITE)
    assert isinstance(ok, torch.Tensor) and ok.dtype == torch.bool and bool(ok) is True
    assert bool(ls.update(_bad(INF))) is False
    assert bool(ls.update(_bad(NAN))) is False
    assert bool(ls.update(_bad(-INF))) is False


def test_increases_every_increment_period_consecutive_finite_steps():
    ls = tf.DynamicLossScale(initial_loss_scale=8.0, increment_period=3, multiplier=2.0)
    seen = []
    for _ in range(7):
        ls.update(FINITE)
        seen.append(ls().item())
    assert seen == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_nonfinite_resets_the_count_and_divides_by_the_multiplier():
    """'If a nonfinite gradient is encountered, the count is reset back to zero' and the
    scale 'is decreased by the factor'."""
    ls = tf.DynamicLossScale(initial_loss_scale=64.0, increment_period=3, multiplier=4.0)
    ls.update(FINITE)
    ls.update(FINITE)  # one more finite step would multiply
    ls.update(_bad())
    assert ls().item() == 16.0  # divided by the multiplier, 4
    ls.update(FINITE)
    ls.update(FINITE)
    assert ls().item() == 16.0  # the count restarted: two finite steps are not three
    ls.update(FINITE)
    assert ls().item() == 64.0  # multiplied by 4


def test_matches_gradscaler_reference():
    """With multiplier 2 the rule is GradScaler's (growth 2, backoff 0.5): same scales and
    counts over a random overflow pattern (one that never reaches the floor of 1)."""
    gen = torch.Generator().manual_seed(3)
    pattern = (torch.rand(300, generator=gen) < 0.15).tolist()
    ls = tf.DynamicLossScale(initial_loss_scale=2.0**20, increment_period=4)
    ref_scale, ref_tracker = torch.tensor(2.0**20), torch.zeros((), dtype=torch.int32)
    for overflow in pattern:
        ls.update(_bad() if overflow else FINITE)
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor(float(overflow)), 2.0, 0.5, 4)
        assert ls().item() == ref_scale.item() >= 1.0
        assert int(ls.counter) == int(ref_tracker)


def test_scale_never_goes_below_one():
    ls = tf.DynamicLossScale(initial_loss_scale=4.0, multiplier=2.0)
    seen = []
    for _ in range(4):
        ls.update(_bad())
        seen.append(ls().item())
    assert seen == [2.0, 1.0, 1.0, 1.0]


def test_growth_is_skipped_where_the_scale_would_become_infinite():
    ls = tf.DynamicLossScale(initial_loss_scale=2.0**127, increment_period=1)
    ls.update(FINITE)
    assert ls().item() == 2.0**127  # 2**128 is not a float32


def test_update_ignores_none_and_accepts_nested_structures():
    ls = tf.DynamicLossScale(initial_loss_scale=8.0, increment_period=1)
    assert bool(ls.update([None, torch.tensor(1.0), None]))
    assert bool(ls.update(torch.tensor([1.0, 2.0])))  # a single tensor
    assert bool(ls.update({"w": [torch.ones(2)], "b": (torch.ones(1), None)}))
    assert not bool(ls.update({"w": [torch.ones(2)], "b": (torch.tensor([NAN]),)}))
    assert ls().item() == 32.0  # x2, x2, x2, then /2


def test_update_leaves_the_gradients_alone():
    grads = [torch.tensor([3.0, INF]), torch.tensor([2.0])]
    tf.DynamicLossScale().update(grads)
    assert grads[0][0].item() == 3.0 and grads[0][1].item() == INF and grads[1].item() == 2.0


def test_float16_gradients_are_checked():
    ls = tf.DynamicLossScale()
    assert not bool(ls.update([torch.tensor([70000.0]).half()]))  # inf in float16
    assert bool(ls.update([torch.tensor([60000.0]).half()]))


def test_get_config_keys_and_values():
    ls = tf.DynamicLossScale(initial_loss_scale=1024.0, increment_period=50, multiplier=3.0)
    assert ls.get_config() == {
        "initial_loss_scale": 1024.0,
        "increment_period": 50,
        "multiplier": 3.0,
    }
    ls.update(_bad())  # state is not config
    assert ls.get_config()["initial_loss_scale"] == 1024.0


def test_from_config_round_trip_gives_a_fresh_equal_loss_scale():
    ls = tf.DynamicLossScale(initial_loss_scale=1024.0, increment_period=50, multiplier=3.0)
    ls.update(_bad())
    clone = tf.DynamicLossScale.from_config(ls.get_config())
    assert isinstance(clone, tf.DynamicLossScale)
    assert clone.get_config() == ls.get_config()
    assert clone().item() == 1024.0  # created from the config: initial state
    assert tf.DynamicLossScale.from_config(tf.DynamicLossScale().get_config()).get_config() == {
        "initial_loss_scale": 32768.0,
        "increment_period": 2000,
        "multiplier": 2.0,
    }


def test_is_the_core_dynamic_loss_scale():
    """No second implementation: the façade is the core state machine with TF's names."""
    ls = tf.DynamicLossScale(initial_loss_scale=8.0, increment_period=5, multiplier=4.0)
    assert isinstance(ls, CoreDynamicLossScale)
    assert (ls.growth_factor, ls.backoff_factor, ls.min_scale, ls.max_scale) == (
        4.0,
        0.25,
        1.0,
        None,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_loss_scale": 0.0},
        {"initial_loss_scale": -8.0},
        {"increment_period": 0},
        {"multiplier": 1.0},
        {"multiplier": 0.5},
    ],
)
def test_invalid_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        tf.DynamicLossScale(**kwargs)


def test_drives_a_loss_scale_optimizer():
    var = torch.tensor(1.0, requires_grad=True)
    ls = tf.DynamicLossScale(initial_loss_scale=64.0, increment_period=2, multiplier=4.0)
    opt = tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([var], lr=0.25), loss_scale=ls)
    assert opt.loss_scaler is ls
    opt.minimize(lambda: var**2, var_list=[var])
    opt.minimize(lambda: var**2, var_list=[var])
    assert ls().item() == 256.0 and var.item() == 0.25
    opt.minimize(lambda: var * 1e37, var_list=[var])  # 1e37 * 256 > float32 max
    assert ls().item() == 64.0 and var.item() == 0.25


# -- FixedLossScale(loss_scale_value), the static member of the same API ----------------


def test_fixed_loss_scale():
    params = inspect.signature(tf.FixedLossScale).parameters
    assert list(params) == ["loss_scale_value"]
    ls = tf.FixedLossScale(128)
    assert ls().dtype == torch.float32 and ls().item() == 128.0
    assert bool(ls.update(FINITE))
    # TensorFlow's FixedLossScale.update returned True always; here the flag says whether
    # the gradients are finite (mixprec optimizers skip non-finite steps for every scale).
    assert not bool(ls.update(_bad()))
    assert ls().item() == 128.0
    assert ls.get_config() == {"loss_scale_value": 128.0}
    assert tf.FixedLossScale.from_config(ls.get_config())().item() == 128.0
    with pytest.raises(ValueError):
        tf.FixedLossScale(0)
