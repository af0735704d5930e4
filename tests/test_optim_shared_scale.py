"""Several optimizers and several losses: one loss scale shared by two
LossScaleOptimizers (a GAN's generator and discriminator), per-optimizer steps
versus ``joint_step``, and several backward passes before one step."""

from __future__ import annotations

import pytest
import torch

from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer, joint_step

KINDS = {
    "noop": NoOpLossScale,
    "static": lambda: StaticLossScale(1024.0),
    "dynamic": lambda: DynamicLossScale(initial_scale=1024.0, growth_interval=2),
}


def gan(seed: int = 0):
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    disc = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return gen, disc


def real_and_noise(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, generator=g) + 1.0, torch.randn(8, 3, generator=g)


bce = torch.nn.functional.binary_cross_entropy_with_logits


def d_loss(gen, disc, real, noise):
    fake = gen(noise).detach()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    return bce(disc(real), ones), bce(disc(fake), zeros)


def g_loss(gen, disc, noise):
    return bce(disc(gen(noise)), torch.ones(len(noise), 1))


def params(*models) -> list[torch.Tensor]:
    return [p.detach().clone() for m in models for p in m.parameters()]


def assert_all_equal(a, b) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def poison(model) -> None:
    next(model.parameters()).grad[0, 0] = float("inf")


def build(gen, disc, kind):
    shared = KINDS[kind]()
    opt_g = LossScaleOptimizer(
        torch.optim.SGD(gen.parameters(), lr=0.1, momentum=0.5), loss_scale=shared
    )
    opt_d = LossScaleOptimizer(
        torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.5), loss_scale=shared
    )
    assert opt_g.loss_scaler is opt_d.loss_scaler
    return opt_g, opt_d


def reference_round(gen, disc, ref_g, ref_d, seed, skip_d=False, skip_g=False):
    """One GAN round in plain float32 (D step, then G step)."""
    real, noise = real_and_noise(seed)
    ref_d.zero_grad()
    ld_real, ld_fake = d_loss(gen, disc, real, noise)
    (ld_real + ld_fake).backward()
    if not skip_d:
        ref_d.step()
    ref_g.zero_grad()
    g_loss(gen, disc, noise).backward()
    if not skip_g:
        ref_g.step()


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_step_skips_only_its_own_overflow_and_the_scale_moves_at_the_next_loss(kind):
    gen, disc = gan()
    ref_gen, ref_disc = gan()
    opt_g, opt_d = build(gen, disc, kind)
    ref_g = torch.optim.SGD(ref_gen.parameters(), lr=0.1, momentum=0.5)
    ref_d = torch.optim.SGD(ref_disc.parameters(), lr=0.1, momentum=0.5)
    scales = []
    # Round 1: D's step overflows; G's is fine. Rounds 2 and 3: both fine.
    for rnd in range(3):
        real, noise = real_and_noise(rnd)
        opt_d.zero_grad()
        ld_real, ld_fake = d_loss(gen, disc, real, noise)
        # Two backward passes before one step: the gradients add up, scaled alike.
        opt_d.scale_loss(ld_real).backward()
        opt_d.scale_loss(ld_fake).backward()
        if rnd == 0:
            d_before = params(disc)
            poison(disc)
        opt_d.step()
        scales.append(float(opt_d.loss_scale))
        if rnd == 0:
            assert_all_equal(d_before, params(disc))  # D skipped ...
        opt_g.zero_grad()
        opt_g.scale_loss(g_loss(gen, disc, noise)).backward()
        g_before = params(gen)
        opt_g.step()
        scales.append(float(opt_g.loss_scale))
        assert not torch.equal(g_before[0], gen[0].weight.detach())  # ... G did not
        reference_round(ref_gen, ref_disc, ref_g, ref_d, rnd, skip_d=rnd == 0)
    for p, r in zip(params(gen, disc), params(ref_gen, ref_disc)):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert [int(opt_d.skipped_steps), int(opt_g.skipped_steps)] == [1, 0]
    assert [int(opt_d.iterations), int(opt_g.iterations)] == [2, 3]
    if kind == "dynamic":
        # Each step's verdict moves the scale when the next loss is scaled (read right
        # after D's step, the scale is still the one D unscaled by): back-off, then
        # growth after 2 finite steps, as GradScaler.update() after every step gives.
        assert scales == [1024.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]
    else:
        assert len(set(scales)) == 1


@pytest.mark.parametrize("overflowing", ["g", "d"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_joint_step_skips_both_if_either_overflows_and_updates_the_scale_once(kind, overflowing):
    gen, disc = gan()
    opt_g, opt_d = build(gen, disc, kind)
    scale0 = float(opt_g.loss_scale)
    real, noise = real_and_noise(0)
    before = params(gen, disc)
    opt_g.scale_loss(g_loss(gen, disc, noise)).backward()
    opt_d.zero_grad()
    opt_d.scale_loss(sum(d_loss(gen, disc, real, noise))).backward()
    poison(gen if overflowing == "g" else disc)
    joint_step(opt_g, opt_d)
    assert_all_equal(before, params(gen, disc))
    assert opt_g.state == {} or all(not s for s in opt_g.state.values())
    assert opt_d.state == {} or all(not s for s in opt_d.state.values())
    for opt in (opt_g, opt_d):
        assert (
            int(opt.skipped_steps) == 1 and int(opt.iterations) == 0 and bool(opt.last_step_skipped)
        )
    # Backed off once (not once per optimizer).
    assert float(opt_g.loss_scale) == (scale0 / 2 if kind == "dynamic" else scale0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_joint_step_applies_both_like_float32_and_counts_one_scale_step(kind):
    gen, disc = gan()
    ref_gen, ref_disc = gan()
    opt_g, opt_d = build(gen, disc, kind)
    ref_g = torch.optim.SGD(ref_gen.parameters(), lr=0.1, momentum=0.5)
    ref_d = torch.optim.SGD(ref_disc.parameters(), lr=0.1, momentum=0.5)
    scales = []
    for rnd in range(3):
        real, noise = real_and_noise(rnd)
        for opt in (opt_g, opt_d):
            opt.zero_grad()
        opt_g.scale_loss(g_loss(gen, disc, noise)).backward()
        opt_d.zero_grad()  # D's gradient from G's loss is not D's business
        opt_d.scale_loss(sum(d_loss(gen, disc, real, noise))).backward()
        joint_step(opt_g, opt_d)
        scales.append(float(opt_g.loss_scale))

        ref_g.zero_grad()
        g_loss(ref_gen, ref_disc, noise).backward()
        ref_d.zero_grad()
        sum(d_loss(ref_gen, ref_disc, real, noise)).backward()
        ref_g.step()
        ref_d.step()
    for p, r in zip(params(gen, disc), params(ref_gen, ref_disc)):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert [int(opt_g.iterations), int(opt_d.iterations)] == [3, 3]
    if kind == "dynamic":  # growth_interval=2: one joint step is one step of the scale
        assert scales == [1024.0, 2048.0, 2048.0]
        assert int(opt_g.loss_scaler.counter) == 1
    else:
        assert scales == [scales[0]] * 3


def test_joint_step_needs_one_shared_scale_and_changes_nothing_otherwise():
    gen, disc = gan()
    opt_g = LossScaleOptimizer(
        torch.optim.SGD(gen.parameters(), lr=0.1), loss_scale=StaticLossScale(64.0)
    )
    opt_d = LossScaleOptimizer(
        torch.optim.SGD(disc.parameters(), lr=0.1), loss_scale=StaticLossScale(64.0)
    )
    real, noise = real_and_noise(0)
    opt_d.scale_loss(sum(d_loss(gen, disc, real, noise))).backward()
    opt_g.scale_loss(g_loss(gen, disc, noise)).backward()
    before = params(gen, disc)
    grads = [p.grad.clone() for m in (gen, disc) for p in m.parameters()]
    with pytest.raises(ValueError, match="share one loss scale"):
        joint_step(opt_g, opt_d)
    assert_all_equal(before, params(gen, disc))
    # The gradients were not unscaled either.
    assert_all_equal(grads, [p.grad for m in (gen, disc) for p in m.parameters()])
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        joint_step(opt_g, torch.optim.SGD(disc.parameters(), lr=0.1))
    with pytest.raises(TypeError):
        joint_step()


@pytest.mark.parametrize("kind", list(KINDS))
def test_several_backward_passes_before_one_step_match_the_summed_loss(kind):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), loss_scale=KINDS[kind](), loss_scale_factor=2.0
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randn(4, 3)
    losses = [
        lambda m: m(x).pow(2).mean(),
        lambda m: (m(x) - 1).abs().mean(),
        lambda m: m(x).sum() * 0.01,
    ]
    for loss in losses:
        opt.scale_loss(loss(model)).backward()
    opt.step()
    sum(loss(ref) for loss in losses).backward()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert int(opt.iterations) == 1


def test_both_backward_before_either_step_unscales_each_by_its_own_scale():
    """G and D backpropagate first, then step; G overflows. D must still unscale by the
    scale its loss was multiplied by, and the shared scale backs off once both stepped."""
    gen, disc = gan()
    ref_gen, ref_disc = gan()
    opt_g, opt_d = build(gen, disc, "dynamic")
    ref_d = torch.optim.SGD(ref_disc.parameters(), lr=0.1, momentum=0.5)
    real, noise = real_and_noise(0)
    opt_g.scale_loss(g_loss(gen, disc, noise)).backward()
    opt_d.zero_grad()  # D's loss alone drives D's step
    ld_real, ld_fake = d_loss(gen, disc, real, noise)
    opt_d.scale_loss(ld_real + ld_fake).backward()
    poison(gen)
    opt_g.step()  # skipped; the shared scale waits for D's verdict
    assert float(opt_d.loss_scale) == 1024.0
    opt_d.step()
    assert float(opt_d.loss_scale) == 512.0  # both stepped: backed off once
    ld_real, ld_fake = d_loss(ref_gen, ref_disc, real, noise)
    (ld_real + ld_fake).backward()
    ref_d.step()
    for p, r in zip(params(disc), params(ref_disc)):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
