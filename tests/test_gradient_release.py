"""Gradient release (mixprec.optim._release) and the memory of the lean 8-bit stack."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from mixprec.optim import AdamW8bit, GradientRelease, LossScaleOptimizer, Split8MasterWeights
from mixprec.tools import live_tensor_bytes


def mlp(dtype=torch.float32, seed=0, width=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 4)).to(dtype)  # fmt: skip


def batch(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(5, 8, generator=gen).to(dtype), torch.randn(5, 4, generator=gen)


def loss_of(model, step, dtype=torch.float32):
    x, y = batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def test_release_equals_an_ordinary_step_and_frees_the_gradients():
    ref, model = mlp(), mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    release = GradientRelease(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for step in range(3):
        loss_of(ref, step).backward()
        opt.step()
        opt.zero_grad()
        loss_of(model, step).backward()
        assert all(p.grad is None for p in model.parameters())  # freed inside backward
        assert release.end_step() == 0
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_split8_with_8bit_states_equals_the_loss_scale_optimizer_step():
    ref, model = mlp(torch.bfloat16), mlp(torch.bfloat16)
    # Rounding to nearest: stochastic rounding draws its noise per optimizer, and release
    # has one optimizer per parameter.
    inner = AdamW8bit(ref.parameters(), lr=1e-2, rounding="nearest")
    opt = LossScaleOptimizer(inner, loss_scale=None)
    opt._master = Split8MasterWeights(inner)
    release = GradientRelease(model, lambda ps: AdamW8bit(ps, lr=1e-2, rounding="nearest"),
                              master_weights="split8")  # fmt: skip
    for step in range(3):
        loss_of(ref, step, torch.bfloat16).backward()
        opt.step()
        opt.zero_grad()
        loss_of(model, step, torch.bfloat16).backward()
        release.end_step()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(opt._master.corrections, [m.corrections[0] for m in release.masters]):
        assert torch.equal(a, b)


def test_a_non_finite_gradient_skips_only_its_parameter_and_is_reported():
    model = mlp(torch.bfloat16)
    release = GradientRelease(model, lambda ps: AdamW8bit(ps, lr=1e-2), master_weights="split8")
    loss_of(model, 0, torch.bfloat16).backward()
    release.end_step()
    before = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
              for opt in release.optimizers]  # fmt: skip
    corrections = [m.corrections[0].clone() for m in release.masters]
    # An inf in the first layer's weight gradient only (its input is inf where x is big).
    model[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
    loss_of(model, 1, torch.bfloat16).backward()
    with pytest.warns(RuntimeWarning, match=r"1 of 4 parameters .*0\.weight.*other parameters were stepped"):
        assert release.end_step() == 1
    after = list(model.parameters())
    assert torch.equal(after[0], before[0])  # skipped: weight, correction, state unchanged
    assert torch.equal(release.masters[0].corrections[0], corrections[0])
    opt0 = release.optimizers[0]
    for key, value in opt0.state[opt0.param_groups[0]["params"][0]].items():
        assert torch.equal(value, states[0][key])
    assert not torch.equal(after[2], before[2])  # the others were stepped
    assert release.skipped_steps.tolist() == [1, 0, 0, 0]
    # The next clean step steps everything again (no warning).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model[0].weight._backward_hooks.clear()
        loss_of(model, 2, torch.bfloat16).backward()
        assert release.end_step() == 0


def test_accumulating_micro_batches_is_refused_with_the_fix():
    model = mlp()
    GradientRelease(model, lambda ps: torch.optim.SGD(ps, lr=0.1))  # the hooks keep it
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="end_step"):
        loss_of(model, 1).backward()


@pytest.mark.parametrize("options, match", [
    ({"global_clipnorm": 1.0}, "global norm"),
    ({"gradient_accumulation_steps": 4}, "accumulate"),
    ({"loss_scale": "dynamic"}, "dynamic loss scale"),
    ({"master_weights": "kahan"}, "lean modes"),
    ({"clipnorm": -1.0}, "clipnorm"),
])  # fmt: skip
def test_options_that_cannot_combine_are_refused(options, match):
    model = mlp(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        GradientRelease(model, lambda ps: torch.optim.SGD(ps, lr=0.1), **options)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_bad_factories_and_parameters_are_refused():
    model = mlp()
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        GradientRelease(model, lambda ps: LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1)))
    with pytest.raises(ValueError, match="holding 4 tensors"):
        GradientRelease(model, lambda ps: torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="split8.*bfloat16"):
        GradientRelease(mlp(torch.float16), lambda ps: torch.optim.SGD(ps, lr=0.1),
                        master_weights="split8")  # fmt: skip
    with pytest.raises(ValueError, match="every parameter is float32"):
        GradientRelease(model, lambda ps: torch.optim.SGD(ps, lr=0.1), master_weights="split8")


def test_per_tensor_clipping_and_a_fixed_loss_scale():
    """``clipnorm`` is LossScaleOptimizer's per-tensor rule, ``g * c / max(||g||, c)``."""
    ref, model, wrapped = mlp(), mlp(), mlp()
    release = GradientRelease(model, lambda ps: torch.optim.SGD(ps, lr=0.1), clipnorm=0.05,
                              loss_scale=64.0)  # fmt: skip
    (loss_of(model, 0) * 64.0).backward()
    release.end_step()
    loss_of(ref, 0).backward()
    opt = LossScaleOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1), loss_scale=64.0,
                             clipnorm=0.05)  # fmt: skip
    opt.scale_loss(loss_of(wrapped, 0)).backward()
    opt.step()
    for p, q, r in zip(ref.parameters(), model.parameters(), wrapped.parameters()):
        grad = p.grad * 0.05 / torch.clamp(p.grad.norm(), min=0.05)
        torch.testing.assert_close(q.detach(), (p - 0.1 * grad).detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(q.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    assert any(p.grad.norm() > 0.05 for p in ref.parameters())  # something was clipped


def test_state_dict_round_trip_is_bit_exact_and_bad_loads_change_nothing():
    def build(model):
        return GradientRelease(model, lambda ps: AdamW8bit(ps, lr=1e-2), master_weights="split8")

    model = mlp(torch.bfloat16)
    release = build(model)
    for step in range(2):
        loss_of(model, step, torch.bfloat16).backward()
        release.end_step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "release": release.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    for step in range(2, 4):
        loss_of(model, step, torch.bfloat16).backward()
        release.end_step()
    other = mlp(torch.bfloat16, seed=3)
    resumed = build(other)
    bad = dict(saved["release"], optimizers=saved["release"]["optimizers"][:-1])
    with pytest.raises(ValueError, match="3 parameters"):
        resumed.load_state_dict(bad)
    assert all(not opt.state for opt in resumed.optimizers)
    resumed.load_state_dict(saved["release"])
    other.load_state_dict(saved["model"])
    for step in range(2, 4):
        loss_of(other, step, torch.bfloat16).backward()
        resumed.end_step()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_remove_gives_ordinary_gradients_back():
    model = mlp()
    release = GradientRelease(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    release.remove()
    loss_of(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())


# -- memory, from live tensor storages (deterministic counts) -----------------------------


def wide(seed=0):
    """Tensors whose sizes are multiples of the 256-element block (no padding)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).bfloat16()


def run_step(model, opt=None):
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    if isinstance(opt, GradientRelease):
        opt.end_step()
    elif opt is not None:
        opt.step()
        opt.zero_grad()


def bytes_per_param(build, with_grads):
    baseline = live_tensor_bytes()
    model = wide()
    opt = build(model)
    run_step(model, opt)  # state exists
    if with_grads:
        model(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean().backward()
    grads = [p.grad for p in model.parameters()]  # Python objects the scan sees
    n = sum(p.numel() for p in model.parameters())
    held = live_tensor_bytes() - baseline
    del grads
    return held / n, n


def split8_8bit(model):
    inner = AdamW8bit(model.parameters(), lr=1e-3)
    opt = LossScaleOptimizer(inner, loss_scale=None)
    opt._master = Split8MasterWeights(inner)
    return opt


def o2(model):
    return LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), loss_scale=None,
                              master_weights="fp32")  # fmt: skip


@pytest.mark.slow  # eight scans of every live object
def test_memory_per_parameter_from_live_storages():
    per_param, n = bytes_per_param(split8_8bit, with_grads=True)
    tensors = 4
    # weight 2 + correction 1 + codes 2 + gradient 2, and the honest extras: two float32
    # scales per 256-element block and one float32 step per tensor.
    exact = 7 + 8 / 256 + 4 * tensors / n
    fixed = 64 / n  # the wrapper's own scalars (step counters): a few bytes per optimizer
    assert exact <= per_param <= exact + fixed
    between, _ = bytes_per_param(split8_8bit, with_grads=False)
    assert exact - 2 <= between <= exact - 2 + fixed

    def released(model):
        return GradientRelease(model, lambda ps: AdamW8bit(ps, lr=1e-3), master_weights="split8")

    with_release, _ = bytes_per_param(released, with_grads=True)  # after backward: no grads
    # The release's own counters: an int64 count and a float32 flag per tensor.
    assert with_release == pytest.approx(5 + 8 / 256 + (4 + 12) * tensors / n, abs=1e-12)
    o2_bytes, _ = bytes_per_param(o2, with_grads=True)
    assert o2_bytes == pytest.approx(2 + 4 + 8 + 2, abs=0.01)


def checkpoint_bytes(build):
    model = wide()
    opt = build(model)
    run_step(model, opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return len(buf.getvalue())


def test_checkpoint_is_at_most_half_of_o2s():
    assert checkpoint_bytes(split8_8bit) <= 0.5 * checkpoint_bytes(o2)
