"""What happens to gradients between the unscale and the inner step: clipping
(clipnorm, clipvalue, global_clipnorm), decoupled weight decay and loss_scale_factor.

Every option must act on the *unscaled* gradients and only on applied steps. The
thresholds are chosen so that the unscaled gradients sit on one side of them and
the scaled gradients (``scale * loss_scale_factor`` times larger) on the other:
a variant that clipped before unscaling gives a different number. Scales are
powers of two, so scaling and unscaling are exact and results can be compared
tightly against plain float32 PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer

KINDS = {
    "noop": NoOpLossScale,
    "static": lambda: StaticLossScale(1024.0),
    "dynamic": lambda: DynamicLossScale(initial_scale=1024.0, growth_interval=1000),
}
# (kind, loss_scale_factor): NoOp with a factor still separates scaled from unscaled.
SCALINGS = [("noop", None), ("noop", 8.0), ("static", None), ("dynamic", None), ("dynamic", 4.0)]
SCALING_IDS = [f"{k}-f{f}" for k, f in SCALINGS]


def total_scale(opt: LossScaleOptimizer) -> float:
    """The factor between the gradients backward produces and the true ones."""
    return float(opt.loss_scale) * (opt.loss_scale_factor or 1.0)


def set_scaled_grads(opt: LossScaleOptimizer, params, grads) -> None:
    """Put on each parameter what backward of ``opt.scale_loss(loss)`` would leave there."""
    s = total_scale(opt)
    assert s > 1.0 or opt.loss_scale_factor is None  # the scale must make a difference
    for p, g in zip(params, grads):
        p.grad = (g * s).to(p.dtype)
    opt.loss_scaler.mark_scaled()  # as scale_loss would


def tiny_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(seed: int = 1, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def mse(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def step_side_by_side(model, opt, ref, ref_opt, seeds) -> None:
    """One batch per seed: the wrapper on ``model``, a plain optimizer on ``ref``."""
    for seed in seeds:
        x, y = batch(seed=seed)
        opt.scale_loss(mse(model, x, y)).backward()
        opt.step()
        opt.zero_grad()
        mse(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()


# -- clipnorm: per-parameter -----------------------------------------------------------


@pytest.mark.parametrize(("kind", "factor"), SCALINGS, ids=SCALING_IDS)
def test_clipnorm_clips_each_unscaled_gradient_separately(kind, factor):
    a = torch.nn.Parameter(torch.zeros(4))
    b = torch.nn.Parameter(torch.zeros(4))
    ga = torch.tensor([0.3, 0.0, -0.4, 0.0])  # norm 0.5: below the threshold, untouched
    gb = torch.tensor([3.0, 0.0, 4.0, 0.0])  # norm 5: clipped to norm 1
    opt = LossScaleOptimizer(
        torch.optim.SGD([a, b], lr=1.0),
        loss_scale=KINDS[kind](),
        clipnorm=1.0,
        loss_scale_factor=factor,
    )
    set_scaled_grads(opt, [a, b], [ga, gb])
    opt.step()
    # Reference: torch's clip on each tensor alone, then the same SGD step.
    ra, rb = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    ra.grad, rb.grad = ga.clone(), gb.clone()
    torch.nn.utils.clip_grad_norm_([ra], 1.0)
    torch.nn.utils.clip_grad_norm_([rb], 1.0)
    torch.testing.assert_close(a.detach(), -ra.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.detach(), -rb.grad, rtol=1e-6, atol=1e-7)
    # The numbers themselves: the small gradient went through unclipped.
    torch.testing.assert_close(a.detach(), -ga, rtol=0, atol=0)
    torch.testing.assert_close(b.detach(), torch.tensor([-0.6, 0.0, -0.8, 0.0]))
    assert int(opt.iterations) == 1 and not bool(opt.last_step_skipped)


# -- clipvalue ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "factor"), SCALINGS, ids=SCALING_IDS)
def test_clipvalue_clamps_unscaled_gradient_elements(kind, factor):
    w = torch.nn.Parameter(torch.zeros(5))
    g = torch.tensor([0.3, -0.7, 2.0, -5.0, 0.0])
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=1.0),
        loss_scale=KINDS[kind](),
        clipvalue=1.0,
        loss_scale_factor=factor,
    )
    set_scaled_grads(opt, [w], [g])
    opt.step()
    # Clamping the scaled gradients would have turned every non-zero entry into +-1/scale.
    assert torch.equal(w.detach(), -g.clamp(-1.0, 1.0))


# -- global_clipnorm ----------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.5, 2.0], ids=["clips", "does-not-clip"])
@pytest.mark.parametrize(("kind", "factor"), SCALINGS, ids=SCALING_IDS)
def test_global_clipnorm_matches_clip_grad_norm_on_unscaled_gradients(kind, factor, ratio):
    model, ref = tiny_mlp(), tiny_mlp()
    x, y = batch()
    # The true (unscaled) global gradient norm, from the float32 reference.
    mse(ref, x, y).backward()
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    threshold = ratio * true_norm
    torch.nn.utils.clip_grad_norm_(ref.parameters(), threshold)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        loss_scale=KINDS[kind](),
        global_clipnorm=threshold,
        loss_scale_factor=factor,
    )
    # A scaled gradient's norm is well above the threshold in both cases.
    assert total_scale(opt) * true_norm > threshold or total_scale(opt) == 1.0
    opt.scale_loss(mse(model, x, y)).backward()
    opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    # With ratio 2 nothing is clipped: the update is the plain SGD update.
    if ratio > 1:
        plain = tiny_mlp()
        mse(plain, x, y).backward()
        torch.optim.SGD(plain.parameters(), lr=0.5).step()
        for p, r in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_global_clipnorm_uses_one_fused_norm_per_device_and_dtype(monkeypatch):
    model = tiny_mlp()
    x, y = batch()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), global_clipnorm=1e-3)
    opt.scale_loss(mse(model, x, y)).backward()
    calls = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    opt.step()
    # All four float32 gradients in one multi-tensor kernel launch.
    assert calls == [4]


def test_global_clipnorm_of_float16_gradients_is_taken_in_float32():
    # Unscaled float16 gradients whose joint norm (about 94868) exceeds float16's range.
    w = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=1.0), loss_scale=NoOpLossScale(), global_clipnorm=1.0
    )
    w.grad = torch.full((1000,), 3000.0, dtype=torch.float16)
    opt.step()
    assert not bool(opt.last_step_skipped)
    expected = torch.full((1000,), -(1000**-0.5), dtype=torch.float16)  # unit-norm update
    torch.testing.assert_close(w.detach(), expected, rtol=2e-3, atol=0)


@pytest.mark.parametrize(
    ("option", "clip"),
    [
        ({"clipvalue": 0.25}, lambda gs: [g.clamp(-0.25, 0.25) for g in gs]),
        ({"clipnorm": 1.0}, lambda gs: [g * min(1.0, 1.0 / float(g.norm())) for g in gs]),
        (
            {"global_clipnorm": 1.0},
            lambda gs: [
                g * min(1.0, 1.0 / float(torch.stack([h.norm() for h in gs]).norm())) for g in gs
            ],
        ),
    ],
    ids=["clipvalue", "clipnorm", "global_clipnorm"],
)
def test_clipping_acts_on_the_unscaled_float32_master_gradients(option, clip):
    gen = torch.Generator().manual_seed(5)
    # Exact in float16; one tensor with a small norm, one with a large one.
    grads = [
        torch.randint(-8, 8, (6,), generator=gen).float() / 64,
        torch.randint(-64, 64, (6,), generator=gen).float() / 16,
    ]
    assert grads[0].abs().max() < 0.25 and grads[0].norm() < 1.0 < grads[1].norm()
    params = [torch.nn.Parameter(torch.zeros(6, dtype=torch.float16)) for _ in grads]
    opt = LossScaleOptimizer(
        torch.optim.SGD(params, lr=1.0),
        loss_scale=StaticLossScale(512.0),
        master_weights=True,
        **option,
    )
    set_scaled_grads(opt, params, grads)
    opt.step()
    masters = [p for g in opt.param_groups for p in g["params"]]
    for m, want in zip(masters, clip(grads)):
        assert m.dtype == torch.float32
        torch.testing.assert_close(m.detach(), -want, rtol=1e-6, atol=1e-7)


# -- clipping happens after the finite check ----------------------------------------------


@pytest.mark.parametrize(
    "option",
    [{"clipvalue": 1.0}, {"clipnorm": 1.0}, {"global_clipnorm": 1.0}],
    ids=lambda o: next(iter(o)),
)
@pytest.mark.parametrize("kind", list(KINDS))
def test_clipping_never_hides_an_overflow(kind, option):
    # Clamping first would turn inf into a finite 1.0 and apply a poisoned step.
    w = torch.nn.Parameter(torch.arange(4.0))
    inner = torch.optim.SGD([w], lr=1.0, momentum=0.9)
    opt = LossScaleOptimizer(inner, loss_scale=KINDS[kind](), **option)
    before_w, scale_before = w.detach().clone(), float(opt.loss_scale)
    w.grad = torch.tensor([float("inf"), 1.0, -1.0, 2.0])
    opt.loss_scaler.mark_scaled()
    opt.step()
    assert torch.equal(w.detach(), before_w)
    assert inner.state == {} or all(not s for s in inner.state.values())
    assert bool(opt.last_step_skipped) and int(opt.skipped_steps) == 1 and int(opt.iterations) == 0
    expected_scale = scale_before / 2 if kind == "dynamic" else scale_before
    assert float(opt.loss_scale) == expected_scale


# -- validation -------------------------------------------------------------------------


def inner_snapshot(inner: torch.optim.Optimizer):
    groups = [
        (
            [id(p) for p in g["params"]],
            [p.dtype for p in g["params"]],
            {k: v for k, v in g.items() if k != "params"},
        )
        for g in inner.param_groups
    ]
    return groups, copy.deepcopy(inner.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"clipnorm": 1.0, "global_clipnorm": 1.0}, ValueError),
        ({"clipnorm": -1.0}, ValueError),
        ({"clipvalue": 0.0}, ValueError),
        ({"global_clipnorm": float("inf")}, ValueError),
        ({"clipnorm": "1"}, TypeError),
        ({"weight_decay": -0.1}, ValueError),
        ({"loss_scale_factor": 0.0}, ValueError),
        ({"loss_scale_factor": -2.0}, ValueError),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else v.__name__,
)
def test_bad_clip_decay_and_factor_options_raise_and_leave_the_inner_optimizer_alone(kwargs, error):
    model = tiny_mlp()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = batch()
    mse(model, x, y).backward()
    inner.step()  # some state to protect
    before = inner_snapshot(inner)
    with pytest.raises(error) as info:
        LossScaleOptimizer(inner, **kwargs)
    assert any(name in str(info.value) for name in kwargs)  # the message names the option
    after = inner_snapshot(inner)
    assert before[0] == after[0]
    assert before[1]["param_groups"] == after[1]["param_groups"]
    for k, s in before[1]["state"].items():
        for name, v in s.items():
            assert torch.equal(v, after[1]["state"][k][name])


def test_clipnorm_with_global_clipnorm_error_names_both():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="clipnorm=0.5.*global_clipnorm=2.0.*at most one"):
        LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), clipnorm=0.5, global_clipnorm=2.0)


# -- decoupled weight decay ---------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_weight_decay_on_adam_equals_adamw(kind):
    model, ref = tiny_mlp(), tiny_mlp()
    lr, wd = 0.05, 0.3
    opt = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=lr), loss_scale=KINDS[kind](), weight_decay=wd
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    step_side_by_side(model, opt, ref, ref_opt, range(10, 14))
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    # The decay did something: plain Adam ends elsewhere.
    plain = tiny_mlp()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=lr)
    for step in range(4):
        x, y = batch(seed=10 + step)
        mse(plain, x, y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    assert not torch.allclose(model[0].weight, plain[0].weight, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_wrapping_adamw_keeps_its_own_decoupled_weight_decay(fused):
    # The wrapper's decoupled_weight_decay attribute must not leak into AdamW's param
    # groups (where a falsy value turns AdamW into Adam with L2 regularisation).
    model, ref = tiny_mlp(), tiny_mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.3, fused=fused)
    opt = LossScaleOptimizer(inner, loss_scale=StaticLossScale(256.0))
    assert inner.param_groups[0]["decoupled_weight_decay"] is True
    assert opt.decoupled_weight_decay is None and opt.weight_decay == 0.3
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.3, fused=fused)
    step_side_by_side(model, opt, ref, ref_opt, range(30, 33))
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert inner.param_groups[0]["decoupled_weight_decay"] is True


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_weight_decay_is_not_applied_on_skipped_steps(kind, fused):
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 4.0]))
    lr, wd = 0.25, 0.5
    inner = torch.optim.SGD([w], lr=lr, fused=fused)
    opt = LossScaleOptimizer(inner, loss_scale=KINDS[kind](), weight_decay=wd)
    g = torch.tensor([0.5, 0.25, -1.0])
    set_scaled_grads(opt, [w], [g])
    opt.step()
    expected = torch.tensor([1.0, -2.0, 4.0]) * (1 - lr * wd) - lr * g
    torch.testing.assert_close(w.detach(), expected, rtol=1e-6, atol=0)

    before = w.detach().clone()
    w.grad = torch.tensor([1.0, float("nan"), 1.0])
    opt.loss_scaler.mark_scaled()
    opt.step()
    assert torch.equal(w.detach(), before)  # no decay factor (0.875) slipped in
    assert int(opt.iterations) == 1 and int(opt.skipped_steps) == 1

    set_scaled_grads(opt, [w], [g])  # the next applied step decays once, not twice
    opt.step()
    torch.testing.assert_close(w.detach(), before * (1 - lr * wd) - lr * g, rtol=1e-6, atol=0)


def test_weight_decay_follows_the_learning_rate_of_each_group():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.4}], lr=0.1)
    opt = LossScaleOptimizer(inner, loss_scale=StaticLossScale(64.0), weight_decay=0.5)
    set_scaled_grads(opt, [a, b], [torch.zeros(2), torch.zeros(2)])
    opt.step()
    torch.testing.assert_close(a.detach(), torch.full((2,), 0.95))
    torch.testing.assert_close(b.detach(), torch.full((2,), 0.8))


# -- loss_scale_factor ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_loss_scale_factor_scales_the_loss_and_is_removed_from_the_gradients(kind):
    model, ref = tiny_mlp(), tiny_mlp()
    factor = 16.0
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        loss_scale=KINDS[kind](),
        loss_scale_factor=factor,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    one = torch.tensor(1.0)
    assert float(opt.scale_loss(one)) == float(opt.loss_scale) * factor
    step_side_by_side(model, opt, ref, ref_opt, range(20, 23))
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_loss_scale_factor_is_independent_of_the_dynamic_scale():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=1.0),
        loss_scale=DynamicLossScale(initial_scale=256.0, growth_interval=1),
        loss_scale_factor=8.0,
    )
    w.grad = torch.tensor([float("inf"), 0.0, 0.0])
    opt.loss_scaler.mark_scaled()
    opt.step()  # overflow: the dynamic scale halves, the factor stays
    assert float(opt.loss_scale) == 128.0 and opt.loss_scale_factor == 8.0
    assert float(opt.scale_loss(torch.tensor(1.0))) == 128.0 * 8.0
    g = torch.tensor([1.0, -2.0, 0.5])
    set_scaled_grads(opt, [w], [g])  # scaled by 128 * 8
    opt.step()  # finite: applied with the factor removed, then the scale grows
    assert torch.equal(w.detach(), -g)
    assert float(opt.loss_scale) == 256.0 and opt.loss_scale_factor == 8.0
    assert float(opt.scale_loss(torch.tensor(1.0))) == 256.0 * 8.0


@pytest.mark.parametrize("factor", [None, 2.0**14], ids=["no-factor", "factor-2**14"])
def test_loss_scale_factor_alone_rescues_float16_gradients_without_loss_scaling(factor):
    # NoOpLossScale + a fixed factor + master weights: the float16 backward sees
    # gradients 2**14 times larger, and the factor comes off in float32.
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=2.0**16),
        loss_scale=NoOpLossScale(),
        loss_scale_factor=factor,
        master_weights=True,
    )
    c = torch.full((4,), 2.0**-12, dtype=torch.float16)
    opt.scale_loss((w * c).sum() * 2.0**-14).backward()  # true gradient: 2**-26
    opt.step()
    master = opt.param_groups[0]["params"][0]
    if factor is None:  # 2**-26 is below float16's smallest subnormal: lost in backward
        assert torch.equal(master.grad, torch.zeros(4))
        assert torch.equal(master, torch.ones(4))
    else:
        assert torch.equal(master.grad, torch.full((4,), 2.0**-26))
        assert torch.equal(master, torch.full((4,), 1.0 - 2.0**-10))
