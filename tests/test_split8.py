"""The "split8" master weights: bfloat16 weight + int8 correction
(mixprec.optim.Split8MasterWeights; its codec is mixprec.kernels.bits')."""

from __future__ import annotations

import io

import pytest
import torch

from mixprec.kernels import join8_bits, split8_bits, split8_error_bound
from mixprec.optim import AdamW8bit, LossScaleOptimizer, Split8MasterWeights
from mixprec.optim.masters import MasterWeights


def with_split8(inner: torch.optim.Optimizer, **options) -> LossScaleOptimizer:
    """A LossScaleOptimizer stepping "split8" masters (built directly, before the wiring)."""
    opt = LossScaleOptimizer(inner, loss_scale=None, **options)
    opt._master = Split8MasterWeights(inner)
    return opt


def roundtrip(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = master.to(torch.bfloat16)
    correction = split8_bits(master, weight)
    return weight, correction, join8_bits(weight, correction)


def assert_within_bound(master: torch.Tensor) -> None:
    weight, correction, rebuilt = roundtrip(master)
    finite = torch.isfinite(weight.float())
    error = (rebuilt.double() - master.double()).abs()
    bound = split8_error_bound(weight).double()
    assert bool((error[finite] <= bound[finite]).all()), error[finite].max()
    bit_distance = (rebuilt.view(torch.int32).long() - master.view(torch.int32).long()).abs()
    assert int(bit_distance[finite].max()) <= 129
    # The rebuilt master rounds to the same weight, and splits to the same correction.
    assert torch.equal(rebuilt.to(torch.bfloat16)[finite], weight[finite])
    assert torch.equal(split8_bits(rebuilt, weight), correction)


def test_reconstruction_within_bound_random_values():
    gen = torch.Generator().manual_seed(0)
    mantissa = torch.rand(20_000, generator=gen) + 1.0
    exponent = torch.randint(-140, 120, (20_000,), generator=gen).float()
    sign = torch.where(torch.rand(20_000, generator=gen) < 0.5, -1.0, 1.0)
    assert_within_bound(sign * mantissa * torch.exp2(exponent))
    assert_within_bound(torch.randn(10_000, generator=gen) * 0.02)


def test_reconstruction_within_bound_adversarial_values():
    powers = torch.exp2(torch.arange(-133, 127, dtype=torch.float32))
    below = torch.nextafter(powers, torch.zeros_like(powers))
    above = torch.nextafter(powers, torch.full_like(powers, float("inf")))
    # Midpoints between neighbouring bfloat16 values (ties) and values a bit either side.
    grid = torch.linspace(-4, 4, 2001).to(torch.bfloat16).float().unique()
    mids = (grid[:-1] + grid[1:]) / 2
    near_mids = torch.cat([torch.nextafter(mids, grid[:-1]), torch.nextafter(mids, grid[1:])])
    subnormals = torch.tensor([1e-45, 2e-45, 1e-40, 5e-39, 1.1754942e-38, 9.2e-41])
    special = torch.tensor([0.0, -0.0, 3.3895314e38, -3.3895314e38, 1.0, -1.0])
    values = torch.cat([powers, below, above, mids, near_mids, subnormals, special])
    assert_within_bound(torch.cat([values, -values]))


def test_exactly_representable_values_come_back_bit_for_bit():
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**-133, -(2.0**-130), 3.0e38])
    values = values.to(torch.bfloat16).float()
    weight, correction, rebuilt = roundtrip(values)
    assert correction.tolist() == [0] * len(values)
    assert torch.equal(rebuilt.view(torch.int32), values.view(torch.int32))  # -0.0 included


def test_non_finite_weights_stay_non_finite():
    master = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4028235e38])
    weight, _, rebuilt = roundtrip(master)
    assert rebuilt[0] == float("inf") and rebuilt[1] == -float("inf")
    assert torch.isnan(rebuilt[2])
    assert rebuilt[3] == float("inf")  # beyond bfloat16's range: the weight is inf already


def test_a_foreign_correction_never_crosses_zero():
    # A correction split from another weight (a model loaded after its optimizer).
    zeros = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=torch.bfloat16)
    rebuilt = join8_bits(zeros, torch.tensor([-127, -127, 127, 127], dtype=torch.int8))
    assert not torch.isnan(rebuilt).any()
    assert rebuilt[0] == 0 and rebuilt[1] == 0
    assert rebuilt[2] > 0 and rebuilt[3] < 0  # same sign as the zero


def test_small_updates_are_kept_where_bfloat16_loses_them():
    w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=2.0**-11)
    split8 = Split8MasterWeights(opt)
    for _ in range(32):  # 32 updates of 1/16 bfloat16 ulp: two ulps in all
        w.grad = -torch.ones_like(w)
        split8.grads_to_masters()
        opt.step()
        split8.masters_to_model()
    assert float(w.detach()[0]) == 1.0 + 2 * 2.0**-7  # pure bfloat16 would stay at 1.0
    assert split8.masters[0].numel() == 0  # released between steps
    assert split8.corrections[0].dtype == torch.int8


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))  # fmt: skip
    model[0].bfloat16()
    model[2].bfloat16()
    return model


def train(model, opt, steps, seed=1, clip=True):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 8, generator=gen).bfloat16()
        h = model[0](x).float()
        loss = model[2](model[1](h).bfloat16()).float().square().mean()
        loss.backward()
        opt.unscale_()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def float32_masters(opt: LossScaleOptimizer) -> list[torch.Tensor]:
    """Every parameter's float32 value as stepped: its master, rebuilt where split8."""
    state = opt._master.state_dict()
    if "corrections" in state:
        pairs = zip(opt._master._low, state["corrections"])
        low = iter([join8_bits(p.detach(), c) for (p, _), c in pairs])
    else:
        low = iter(state["masters"])
    return [next(low) if p.dtype == torch.bfloat16 else p.detach()
            for p in opt._master.model_params]  # fmt: skip


@pytest.mark.parametrize("inner", [torch.optim.AdamW, AdamW8bit])
def test_training_tracks_float32_masters_where_bfloat16_stalls(inner):
    lr, steps = 1e-4, 8  # updates of 1e-4 are below half a bfloat16 ulp of most weights
    runs = {}
    for mode in ("fp32", "split8", False):
        model = tiny_model()
        if mode == "split8":
            opt = with_split8(inner(model.parameters(), lr=lr))
            assert opt.master_weights == "split8"
        else:
            opt = LossScaleOptimizer(inner(model.parameters(), lr=lr), loss_scale=None,
                                     master_weights=mode)  # fmt: skip
        train(model, opt, steps)
        runs[mode] = float32_masters(opt) if mode else [p.detach().float() for p in model.parameters()]

    def gap(mode):
        return max(float((a - b).abs().max()) for a, b in zip(runs["fp32"], runs[mode]))

    # Each weight moves up to lr * steps; split8 agrees with float32 masters to a few
    # percent of that (the forward passes see weights one bfloat16 ulp apart at times),
    # pure bfloat16 loses whole updates.
    assert gap("split8") <= 0.05 * lr * steps
    assert gap(False) >= 0.5 * lr * steps


def test_unscale_shows_the_float32_master_for_clipping():
    model = tiny_model()
    opt = with_split8(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model[0](torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.unscale_()
    assert model[0].weight.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
    opt.step()
    assert model[0].weight.dtype == torch.bfloat16
    assert opt.inner_optimizer.param_groups[0]["params"][0].numel() == 0


def save(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("inner", [torch.optim.AdamW, AdamW8bit])
@pytest.mark.parametrize("model_first", [True, False])
def test_checkpoint_resumes_bit_exactly(inner, model_first):
    model = tiny_model()
    opt = with_split8(inner(model.parameters(), lr=1e-2))
    train(model, opt, 3)
    saved = torch.load(save({"model": model.state_dict(), "opt": opt.state_dict()}),
                       weights_only=True)  # fmt: skip
    train(model, opt, 3, seed=2)
    resumed = tiny_model(seed=7)  # other weights: everything must come from the checkpoint
    ropt = with_split8(inner(resumed.parameters(), lr=1e-2))
    if model_first:
        resumed.load_state_dict(saved["model"])
        ropt.load_state_dict(saved["opt"])
    else:
        ropt.load_state_dict(saved["opt"])
        resumed.load_state_dict(saved["model"])
    train(resumed, ropt, 3, seed=2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(opt.state_dict()["mixprec"]["master"]["corrections"],
                    ropt.state_dict()["mixprec"]["master"]["corrections"]):  # fmt: skip
        assert torch.equal(a, b)


def test_state_dict_holds_int8_corrections_only():
    model = tiny_model()
    opt = with_split8(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = opt._master.state_dict()
    assert state["mode"] == "split8" and set(state) == {"mode", "corrections"}
    assert [c.dtype for c in state["corrections"]] == [torch.int8] * 4
    assert [c.shape for c in state["corrections"]] == [p.shape for p in (
        model[0].weight, model[0].bias, model[2].weight, model[2].bias)]  # fmt: skip


def corrupt(state, how):
    corrections = [c.clone() for c in state["corrections"]]
    if how == "count":
        corrections = corrections[:-1]
    elif how == "dtype":
        corrections[1] = corrections[1].to(torch.int16)
    elif how == "shape":
        corrections[-1] = corrections[-1][:-1]
    elif how == "mode":
        return {"mode": "kahan", "compensation": [], "generators": {}}
    return {"mode": "split8", "corrections": corrections}


@pytest.mark.parametrize("how", ["count", "dtype", "shape", "mode"])
def test_bad_checkpoints_are_refused_before_anything_changes(how):
    model = tiny_model()
    opt = with_split8(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(model, opt, 2)
    before = [c.clone() for c in opt._master.corrections]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="split8|kahan"):
        opt._master.load_state_dict(corrupt(opt._master.state_dict(), how))
    assert all(torch.equal(a, b) for a, b in zip(before, opt._master.corrections))
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_float32_master_checkpoints_load_rounded_to_split8():
    model = tiny_model()
    fp32 = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scale=None,
                              master_weights="fp32")  # fmt: skip
    train(model, fp32, 2)
    masters = fp32._master.state_dict()["masters"]
    other = tiny_model(seed=3)
    split8 = Split8MasterWeights(torch.optim.AdamW(other.parameters(), lr=1e-2))
    split8.load_state_dict({"masters": masters})
    low = [m for m in masters if m.numel() and m.dtype == torch.float32]
    for master, (p, _), correction in zip(low, split8._low, split8.corrections):
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        assert torch.equal(correction, split8_bits(master, master.to(torch.bfloat16)))


def test_refuses_float16_and_all_float32_parameters():
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="split8.*bfloat16"):
        Split8MasterWeights(torch.optim.SGD([half], lr=0.1))
    single = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        Split8MasterWeights(torch.optim.SGD([single], lr=0.1))
    assert issubclass(Split8MasterWeights, MasterWeights)  # unscale_() shows its masters
