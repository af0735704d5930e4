"""gradient_accumulation_steps=N: parameters and optimizer state change every N
step() calls, with the average of the N unscaled micro-batch gradients; one
overflowing micro-batch skips the whole window and backs the scale off once."""

from __future__ import annotations

import io

import pytest
import torch

from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer, joint_step

KINDS = {
    "noop": NoOpLossScale,
    "static": lambda: StaticLossScale(1024.0),
    "dynamic": lambda: DynamicLossScale(initial_scale=1024.0, growth_interval=1000),
}
# SGD with momentum sees the gradient's size (a sum instead of an average shows);
# Adam sees its direction.
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
}


def tiny_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def data(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def state_of(opt) -> dict:
    return {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}


def assert_all_equal(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_n_micro_batches_equal_one_big_batch(kind, optimizer):
    n_steps, micro, size = 3, 4, 8  # windows, micro-batches per window, micro-batch size
    model, ref = tiny_mlp(), tiny_mlp()
    opt = LossScaleOptimizer(
        OPTIMIZERS[optimizer](model.parameters()),
        loss_scale=KINDS[kind](),
        gradient_accumulation_steps=micro,
    )
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    for step in range(n_steps):
        x, y = data(step, micro * size)
        for i in range(micro):
            sl = slice(i * size, (i + 1) * size)
            opt.scale_loss(mse(model, x[sl], y[sl])).backward()
            opt.step()
            opt.zero_grad()
        mse(ref, x, y).backward()  # one batch of micro * size
        ref_opt.step()
        ref_opt.zero_grad()
    assert int(opt.iterations) == n_steps
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_parameters_and_state_change_only_every_n_calls(optimizer):
    model = tiny_mlp()
    opt = LossScaleOptimizer(
        OPTIMIZERS[optimizer](model.parameters()),
        loss_scale=StaticLossScale(256.0),
        gradient_accumulation_steps=3,
    )
    for call in range(7):
        params, state = params_of(model), state_of(opt)
        x, y = data(call, 8)
        opt.scale_loss(mse(model, x, y)).backward()
        opt.step()
        opt.zero_grad()
        if call % 3 == 2:  # the third call of a window applies the update
            assert not torch.equal(params[0], model[0].weight.detach())
            assert state_of(opt) != {} and int(opt.iterations) == call // 3 + 1
        else:
            assert_all_equal(params, params_of(model))
            assert_state_equal(state, state_of(opt))
            assert int(opt.iterations) == call // 3


@pytest.mark.parametrize("bad_micro_batch", [0, 1, 2])
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_overflowing_micro_batch_skips_the_window_and_nothing_leaks(kind, bad_micro_batch):
    micro = 3
    model, ref = tiny_mlp(), tiny_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = LossScaleOptimizer(inner, loss_scale=KINDS[kind](), gradient_accumulation_steps=micro)
    scale0 = float(opt.loss_scale)
    params, state = params_of(model), state_of(opt)

    # Window 1: one micro-batch's gradient gets an inf from a hook.
    x, y = data(0, 4 * micro)
    for i in range(micro):
        handle = None
        if i == bad_micro_batch:
            handle = model[2].bias.register_hook(lambda g: g + float("inf"))
        opt.scale_loss(mse(model, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])).backward()
        if handle is not None:
            handle.remove()
        opt.step()
        opt.zero_grad()
        if i < micro - 1:  # nothing happens to the scale inside a window
            assert float(opt.loss_scale) == scale0
    assert_all_equal(params, params_of(model))
    assert_state_equal(state, state_of(opt))
    assert int(opt.skipped_steps) == 1 and int(opt.iterations) == 0 and bool(opt.last_step_skipped)
    # Backed off once for the window (not once per micro-batch, not never).
    assert float(opt.loss_scale) == (scale0 / 2 if kind == "dynamic" else scale0)

    # Window 2 is clean and must equal a fresh reference that only ever saw window 2.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data(1, 4 * micro)
    for i in range(micro):
        opt.scale_loss(mse(model, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])).backward()
        opt.step()
        opt.zero_grad()
    mse(ref, x, y).backward()
    ref_opt.step()
    assert int(opt.iterations) == 1 and not bool(opt.last_step_skipped)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_the_scale_grows_once_per_window():
    model = tiny_mlp()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_scale=DynamicLossScale(initial_scale=64.0, growth_interval=1),
        gradient_accumulation_steps=4,
    )
    scales = []
    for call in range(8):
        x, y = data(call, 4)
        opt.scale_loss(mse(model, x, y)).backward()
        opt.step()
        opt.zero_grad()
        scales.append(float(opt.loss_scale))
    assert scales == [64.0] * 3 + [128.0] * 4 + [256.0]


def test_manual_gradients_average_exactly_with_master_weights():
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=1.0),
        loss_scale=StaticLossScale(2.0**12),
        gradient_accumulation_steps=2,
        master_weights=True,
    )
    # Unscaled micro-batch gradients 2**-20 and 3 * 2**-20: below float16's normal range
    # once unscaled, so they must be summed in float32 after the unscale.
    for g in (1.0, 3.0):
        w.grad = torch.full((3,), g * 2.0**-20 * 2.0**12, dtype=torch.float16)
        opt.loss_scaler.mark_scaled()  # gradients scaled by hand
        opt.step()
        opt.zero_grad()
    master = opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32
    assert torch.equal(master, torch.full((3,), -2.0 * 2.0**-20))


def test_a_checkpoint_in_the_middle_of_a_window_continues_identically():
    def build(model):
        return LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            loss_scale=DynamicLossScale(initial_scale=256.0, growth_interval=2),
            gradient_accumulation_steps=3,
        )

    def micro_step(opt, model, i):
        x, y = data(100 + i, 4)
        opt.scale_loss(mse(model, x, y)).backward()
        opt.step()
        opt.zero_grad()

    model = tiny_mlp()
    opt = build(model)
    for i in range(5):  # one full window and two micro-batches of the next
        micro_step(opt, model, i)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh = tiny_mlp(seed=7)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt = build(fresh)
    fresh_opt.load_state_dict(ckpt["opt"])
    for i in range(5, 9):
        micro_step(opt, model, i)
        micro_step(fresh_opt, fresh, i)
    assert int(fresh_opt.iterations) == 3
    assert_all_equal(params_of(model), params_of(fresh))
    assert_state_equal(state_of(opt), state_of(fresh_opt))
    # Without the saved partial sums the continued run ends elsewhere.
    lost = tiny_mlp(seed=7)
    lost.load_state_dict(ckpt["model"])
    lost_opt = build(lost)
    sd = ckpt["opt"]
    sd["accumulation"] = build(tiny_mlp()).state_dict()["mixprec"]["accumulation"]
    lost_opt.load_state_dict(sd)
    for i in range(5, 9):
        micro_step(lost_opt, lost, i)
    assert not torch.allclose(lost[0].weight, model[0].weight)


@pytest.mark.parametrize(
    ("steps", "error"),
    [(-1, ValueError), (0, ValueError), (2.5, TypeError), (True, TypeError), ("2", TypeError)],
)
def test_bad_accumulation_steps_raise_and_leave_the_inner_optimizer_alone(steps, error):
    model = tiny_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data(0, 4)
    mse(model, x, y).backward()
    inner.step()
    groups = [[id(p) for p in g["params"]] for g in inner.param_groups]
    state = state_of(inner)
    with pytest.raises(error, match="gradient_accumulation_steps"):
        LossScaleOptimizer(inner, gradient_accumulation_steps=steps)
    assert [[id(p) for p in g["params"]] for g in inner.param_groups] == groups
    assert_state_equal(state, state_of(inner))


def test_joint_step_refuses_accumulation():
    shared = DynamicLossScale()
    a, b = tiny_mlp(0), tiny_mlp(1)
    opt_a = LossScaleOptimizer(
        torch.optim.SGD(a.parameters(), lr=0.1), loss_scale=shared, gradient_accumulation_steps=2
    )
    opt_b = LossScaleOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), loss_scale=shared)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        joint_step(opt_a, opt_b)
