"""EMA of parameters (use_ema, ema_momentum, ema_overwrite_frequency,
copy_ema_to_params): updated only on applied steps, checked against the Keras
formula computed by hand from the parameter trajectory."""

from __future__ import annotations

import io

import pytest
import torch

from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer

KINDS = {
    "noop": NoOpLossScale,
    "static": lambda: StaticLossScale(1024.0),
    "dynamic": lambda: DynamicLossScale(initial_scale=1024.0, growth_interval=1000),
}


def tiny_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return model.to(dtype)


def batch(seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g).to(dtype), torch.randn(8, 2, generator=g).to(dtype)


def loss_of(model, seed: int) -> torch.Tensor:
    x, y = batch(seed, next(model.parameters()).dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def poison(model) -> None:
    """Make this step overflow: an inf in one gradient, as a hook or a bad batch would."""
    next(model.parameters()).grad[0, 0] = float("inf")


def ema_step(opt, model, seed: int, overflow: bool = False) -> None:
    opt.scale_loss(loss_of(model, seed)).backward()
    if overflow:
        poison(model)
    opt.step()
    opt.zero_grad()


def averages(opt) -> list[torch.Tensor]:
    return [a.clone() for a in opt.state_dict()["mixprec"]["ema"]["averages"]]


def keras_ema(trajectory: list[list[torch.Tensor]], momentum: float) -> list[torch.Tensor]:
    """avg = params at the first applied step, then m * avg + (1 - m) * params."""
    avg = [t.double() for t in trajectory[0]]
    for params in trajectory[1:]:
        avg = [momentum * a + (1 - momentum) * p.double() for a, p in zip(avg, params)]
    return [a.float() for a in avg]


@pytest.mark.parametrize("kind", list(KINDS))
def test_ema_follows_the_keras_formula_and_ignores_skipped_steps(kind):
    model = tiny_mlp()
    m = 0.6
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2),
        loss_scale=KINDS[kind](),
        use_ema=True,
        ema_momentum=m,
    )
    pattern = [False, False, True, False, True, True, False]  # True: the step overflows
    trajectory = []
    for i, overflow in enumerate(pattern):
        before = averages(opt)
        ema_step(opt, model, seed=i, overflow=overflow)
        if overflow:
            for a, b in zip(before, averages(opt)):
                assert torch.equal(a, b)  # a skipped step leaves the average exactly alone
        else:
            trajectory.append([p.detach().clone() for p in model.parameters()])
    assert int(opt.skipped_steps) == 3 and int(opt.iterations) == 4
    for got, want in zip(averages(opt), keras_ema(trajectory, m)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # Folding the skipped steps' (unchanged) parameters in as well gives other numbers.
    padded = [
        trajectory[0],
        trajectory[1],
        trajectory[1],
        trajectory[2],
        trajectory[2],
        trajectory[2],
        trajectory[3],
    ]
    wrong = keras_ema(padded, m)
    assert not all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(averages(opt), wrong))


def test_the_first_applied_step_copies_even_after_skipped_ones():
    model = tiny_mlp()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2), use_ema=True, ema_momentum=0.9
    )
    initial = averages(opt)
    ema_step(opt, model, seed=0, overflow=True)
    ema_step(opt, model, seed=1, overflow=True)
    for a, b in zip(initial, averages(opt)):
        assert torch.equal(a, b)
    ema_step(opt, model, seed=2)
    # The first applied step: the average is the parameters, not 0.9 * init + 0.1 * params.
    for a, p in zip(averages(opt), model.parameters()):
        assert torch.equal(a, p.detach())


@pytest.mark.parametrize("kind", list(KINDS))
def test_overwrite_every_n_applied_steps(kind):
    model = tiny_mlp()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        loss_scale=KINDS[kind](),
        use_ema=True,
        ema_momentum=0.5,
        ema_overwrite_frequency=3,
    )
    pattern = [False, False, True, False, False, False, True, False]
    overwritten = []
    for i, overflow in enumerate(pattern):
        params_before = [p.detach().clone() for p in model.parameters()]
        ema_step(opt, model, seed=i, overflow=overflow)
        same_as_avg = all(
            torch.equal(p.detach(), a) for p, a in zip(model.parameters(), averages(opt))
        )
        moved = any(
            not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), params_before)
        )
        overwritten.append(same_as_avg and moved and i > 0)
        if overflow:
            assert not moved
    # Applied steps are calls 0,1,3,4,5,7: the 3rd and 6th applied are calls 3 and 7.
    assert overwritten == [False, False, False, True, False, False, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_finalize_writes_the_averages_into_the_model(dtype):
    model = tiny_mlp(dtype=dtype)
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2),
        loss_scale=StaticLossScale(256.0),
        use_ema=True,
        ema_momentum=0.7,
        master_weights=dtype != torch.float32,
    )
    for i in range(4):
        ema_step(opt, model, seed=i)
    avg = averages(opt)
    assert all(a.dtype == torch.float32 for a in avg)
    assert any(not torch.equal(p.detach().float(), a) for p, a in zip(model.parameters(), avg))
    opt.copy_ema_to_params()
    for p, a in zip(model.parameters(), avg):
        assert torch.equal(p.detach(), a.to(dtype))
    if dtype != torch.float32:  # the masters hold the float32 averages
        for m, a in zip(opt.param_groups[0]["params"], avg):
            assert torch.equal(m, a)


def test_finalize_without_ema_raises():
    model = tiny_mlp()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="use_ema=True"):
        opt.copy_ema_to_params()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ema_momentum": -0.01}, ValueError),
        ({"ema_momentum": 1.5}, ValueError),
        ({"ema_momentum": float("nan")}, ValueError),
        ({"ema_momentum": "0.9"}, TypeError),
        ({"ema_overwrite_frequency": 0}, ValueError),
        ({"ema_overwrite_frequency": 2.5}, TypeError),
    ],
    ids=str,
)
def test_bad_ema_options_raise_and_leave_the_inner_optimizer_alone(kwargs, error):
    model = tiny_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, 0).backward()
    inner.step()
    groups = [[id(p) for p in g["params"]] for g in inner.param_groups]
    state = {id(p): s["momentum_buffer"].clone() for p, s in inner.state.items()}
    with pytest.raises(error, match="ema_"):
        LossScaleOptimizer(inner, use_ema=True, **kwargs)
    assert [[id(p) for p in g["params"]] for g in inner.param_groups] == groups
    assert all(torch.equal(inner.state[p]["momentum_buffer"], state[id(p)]) for p in inner.state)


@pytest.mark.parametrize("momentum", [0.0, 1.0])
def test_momentum_bounds_are_allowed(momentum):
    model = tiny_mlp()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2), use_ema=True, ema_momentum=momentum
    )
    ema_step(opt, model, seed=0)
    first = [p.detach().clone() for p in model.parameters()]
    ema_step(opt, model, seed=1)
    expected = first if momentum == 1.0 else [p.detach() for p in model.parameters()]
    for a, e in zip(averages(opt), expected):
        assert torch.equal(a, e)


def test_ema_survives_a_checkpoint():
    def build(model):
        return LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
            loss_scale=DynamicLossScale(initial_scale=512.0, growth_interval=2),
            use_ema=True,
            ema_momentum=0.8,
            ema_overwrite_frequency=4,
        )

    model = tiny_mlp()
    opt = build(model)
    for i in range(3):
        ema_step(opt, model, seed=i, overflow=i == 1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh = tiny_mlp(seed=99)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt = build(fresh)
    fresh_opt.load_state_dict(ckpt["opt"])
    for a, b in zip(averages(opt), averages(fresh_opt)):
        assert torch.equal(a, b)
    for i in range(3, 8):
        ema_step(opt, model, seed=i)
        ema_step(fresh_opt, fresh, seed=i)
    for a, b in zip(averages(opt), averages(fresh_opt)):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
