"""Loss scales: the dynamic rule against GradScaler and a plain-Python reference,
round trips of config and state, validation, and the fused unscale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_from_spec,
)
from mixprec.tools import HostSyncCounter

ALL_KINDS = [
    NoOpLossScale(),
    StaticLossScale(512.0),
    DynamicLossScale(hysteresis=2, min_scale=None),
]


def gradscaler_scales(
    pattern: list[bool], init: float, interval: int, growth: float, backoff: float
):
    """The scale after each step of torch.amp.GradScaler, on a given overflow pattern."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
    )
    scales = []
    for overflow in pattern:
        scaler.scale(torch.ones(()))  # GradScaler insists on scale() before step()
        p.grad = torch.tensor([float("inf") if overflow else 1.0, 1.0])
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def mixprec_scales(ls: LossScale, pattern: list[bool]) -> list[float]:
    scales = []
    for overflow in pattern:
        g = torch.tensor([float("inf") if overflow else 1.0, 1.0])
        found_inf = ls.unscale_([g])
        ls.update(found_inf)
        scales.append(float(ls.scale))
    return scales


def test_matches_gradscaler_on_a_fixed_pattern():
    pattern = [True, False, False, False, True, True] + [False] * 7 + [True, False, False]
    ours = DynamicLossScale(
        initial_scale=2.0**16, growth_interval=3, min_scale=None, max_scale=None
    )
    expected = gradscaler_scales(pattern, 2.0**16, 3, 2.0, 0.5)
    assert mixprec_scales(ours, pattern) == expected
    # The pattern exercises growth and backoff both.
    steps = list(zip(expected, expected[1:]))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps)


@settings(max_examples=40, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=40),
    interval=st.integers(1, 5),
    growth=st.sampled_from([2.0, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.25, 0.125]),
)
def test_matches_gradscaler_property(pattern, interval, growth, backoff):
    ours = DynamicLossScale(
        initial_scale=2.0**16,
        growth_interval=interval,
        growth_factor=growth,
        backoff_factor=backoff,
        min_scale=None,
        max_scale=None,
    )
    assert mixprec_scales(ours, pattern) == gradscaler_scales(
        pattern, 2.0**16, interval, growth, backoff
    )


def reference_rule(pattern, initial, interval, growth, backoff, lo, hi, hysteresis):
    """The documented rule in plain Python (float32 arithmetic, like the tensors)."""
    f32 = np.float32
    scale, counter, streak = f32(initial), 0, 0
    out = []
    for overflow in pattern:
        if overflow:
            counter = 0
            streak += 1
            if streak >= hysteresis:
                scale = f32(scale * f32(backoff))
                if lo is not None:
                    scale = max(scale, f32(lo))
        else:
            streak = 0
            counter += 1
            if counter >= interval:
                counter = 0
                grown = f32(scale * f32(growth))
                if hi is not None:
                    grown = min(grown, f32(hi))
                if np.isfinite(grown):
                    scale = grown
        out.append((float(scale), counter, streak))
    return out


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=60),
    initial_exp=st.integers(0, 20),
    interval=st.integers(1, 6),
    growth=st.sampled_from([2.0, 3.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.3, 0.25]),
    lo=st.sampled_from([None, 1.0, 16.0]),
    hi=st.sampled_from([None, 2.0**20, 2.0**24]),
    hysteresis=st.integers(1, 3),
)
def test_rule_matches_plain_python_reference(
    pattern, initial_exp, interval, growth, backoff, lo, hi, hysteresis
):
    initial = 2.0**initial_exp
    low = 0.0 if lo is None else lo
    high = float("inf") if hi is None else hi
    if not low <= initial <= high:
        with pytest.raises(ValueError, match="initial_scale"):
            DynamicLossScale(initial_scale=initial, min_scale=lo, max_scale=hi)
        return
    ls = DynamicLossScale(
        initial_scale=initial,
        growth_interval=interval,
        growth_factor=growth,
        backoff_factor=backoff,
        min_scale=lo,
        max_scale=hi,
        hysteresis=hysteresis,
    )
    got = []
    for overflow in pattern:
        ls.update(torch.tensor(1.0 if overflow else 0.0))
        got.append((float(ls.scale), int(ls.counter), int(ls.inf_streak)))
    assert got == reference_rule(pattern, initial, interval, growth, backoff, lo, hi, hysteresis)


def test_hysteresis_backs_off_only_after_consecutive_overflows():
    ls = DynamicLossScale(initial_scale=1024.0, hysteresis=2)
    for overflow, expected in [(1, 1024), (0, 1024), (1, 1024), (1, 512), (1, 256), (0, 256)]:
        ls.update(torch.tensor(float(overflow)))
        assert float(ls.scale) == expected


def test_scale_is_bounded_and_never_infinite():
    ls = DynamicLossScale(initial_scale=2.0**24, growth_interval=1, max_scale=None, min_scale=None)
    for _ in range(200):
        ls.update(torch.tensor(0.0))
    assert torch.isfinite(ls.scale) and float(ls.scale) > 2.0**100
    capped = DynamicLossScale(initial_scale=4.0, growth_interval=1, max_scale=16.0, min_scale=2.0)
    for _ in range(5):
        capped.update(torch.tensor(0.0))
    assert float(capped.scale) == 16.0
    for _ in range(5):
        capped.update(torch.tensor(1.0))
    assert float(capped.scale) == 2.0


def test_update_is_branch_free_no_host_sync():
    ls = DynamicLossScale(growth_interval=2)
    grads = [torch.randn(10).half() * 100, torch.randn(3).bfloat16(), None]
    with HostSyncCounter() as syncs:
        for _ in range(5):
            found_inf = ls.unscale_(grads)
            ls.update(found_inf)
    assert syncs.count == 0, syncs.events


@pytest.mark.parametrize("ls", ALL_KINDS, ids=lambda ls: type(ls).__name__)
def test_config_and_state_round_trip(ls):
    for overflow in [0.0, 1.0, 0.0, 0.0]:
        ls.update(torch.tensor(overflow))
    clone = type(ls).from_config(ls.get_config())
    assert clone.get_config() == ls.get_config()
    clone.load_state_dict(ls.state_dict())
    assert {k: v.tolist() for k, v in clone.state_dict().items()} == {
        k: v.tolist() for k, v in ls.state_dict().items()
    }
    # Every dataclass field is either config or state: nothing silently dropped.
    import dataclasses

    names = {f.name for f in dataclasses.fields(ls)}
    assert names == set(ls.get_config()) | set(ls.state_dict())
    # Both continue identically.
    for overflow in [0.0, 1.0, 0.0]:
        ls.update(torch.tensor(overflow))
        clone.update(torch.tensor(overflow))
        assert torch.equal(ls.scale, clone.scale)


def test_load_state_dict_rejects_foreign_state_and_changes_nothing():
    ls = DynamicLossScale(initial_scale=64.0)
    before = ls.state_dict()
    with pytest.raises(ValueError, match="expects keys"):
        ls.load_state_dict(StaticLossScale(8.0).state_dict())
    with pytest.raises(ValueError, match="one-element"):
        ls.load_state_dict(
            {"scale": torch.ones(2), "counter": torch.tensor(0), "inf_streak": torch.tensor(0),
             "floor_streak": torch.tensor(0)}  # fmt: skip
        )
    assert all(torch.equal(before[k], v) for k, v in ls.state_dict().items())
    with pytest.raises(ValueError, match="does not take"):
        DynamicLossScale.from_config({"initial_scale": 2.0, "bogus": 1})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"initial_scale": 0.0}, ValueError, "initial_scale"),
        ({"initial_scale": -4.0}, ValueError, "initial_scale"),
        ({"initial_scale": "big"}, TypeError, "initial_scale"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor"),
        ({"hysteresis": 0}, ValueError, "hysteresis"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0}, ValueError, "min_scale"),
        ({"initial_scale": 2.0**30}, ValueError, "outside"),
    ],
)
def test_dynamic_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScale(**kwargs)


def test_static_validation_and_spec():
    with pytest.raises(ValueError, match="loss_scale"):
        StaticLossScale(float("inf"))
    with pytest.raises(TypeError, match="loss_scale"):
        StaticLossScale(True)
    assert isinstance(loss_scale_from_spec(None), NoOpLossScale)
    assert isinstance(loss_scale_from_spec("dynamic"), DynamicLossScale)
    assert float(loss_scale_from_spec(256).scale) == 256.0
    with pytest.raises(ValueError, match="loss_scale must be"):
        loss_scale_from_spec("huge")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_divides_in_place_and_flags_non_finite(dtype):
    ls = StaticLossScale(8.0)
    g = torch.tensor([8.0, 16.0], dtype=dtype)
    found = ls.unscale_([g, None])
    assert torch.equal(g, torch.tensor([1.0, 2.0], dtype=dtype)) and float(found) == 0.0
    bad = [torch.tensor([1.0], dtype=dtype), torch.tensor([float("nan")], dtype=torch.float32)]
    assert float(ls.unscale_(bad)) == 1.0
    assert ls.scale.dtype == torch.float32


def test_scale_loss_multiplies_and_keeps_graph():
    w = torch.ones(3, requires_grad=True)
    ls = StaticLossScale(4.0)
    ls.scale_loss((w * 2).sum(), extra_factor=0.5).backward()
    assert torch.equal(w.grad, torch.full((3,), 4.0))
    with pytest.raises(TypeError, match="loss must be"):
        ls.scale_loss(3.0)
