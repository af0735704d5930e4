"""The porting pitfalls the guides name, checked: the settings that give
``LossScaleOptimizer`` exactly ``torch.amp.GradScaler``'s rule (bit for bit over a run
that grows past mixprec's default ceiling, overflows below its floor and past its
collapse count), and an EMA copy of an O2 model kept in float32 (timm/diffusers style)."""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec import DynamicLossScale, LossScaleOptimizer, ScaleCollapseError, amp

#: The settings the loss-scaling guide gives for GradScaler's rule.
GRADSCALER_RULE = dict(initial_scale=2.0**16, min_scale=None, max_scale=None,
                       collapse_after=None)  # fmt: skip

#: 12 finite steps (growth every step: past 2**24), 130 overflows in a row (below 1,
#: and more than 100 in a row at mixprec's default floor), 5 finite, 1 overflow, 3 finite.
PATTERN = [False] * 12 + [True] * 130 + [False] * 5 + [True] + [False] * 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    for overflow in PATTERN:
        factor = float("inf") if overflow else 1.0
        yield torch.randn(4, 6, generator=g), factor


def loss_of(model, x, factor):
    return model(x).square().mean() * factor


def run_torch(growth_interval):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    scales = []
    for x, factor in batches():
        scaler.scale(loss_of(model, x, factor)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def run_mixprec(**rule):
    model = make_model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                             loss_scale=DynamicLossScale(**rule))  # fmt: skip
    scales = []
    for x, factor in batches():
        opt.scale_loss(loss_of(model, x, factor)).backward()
        opt.step()
        opt.zero_grad()
        scales.append(float(opt.loss_scale))
    return scales, [p.detach().clone() for p in model.parameters()]


def test_the_documented_settings_are_gradscalers_rule_bit_for_bit():
    torch_scales, torch_params = run_torch(growth_interval=1)
    scales, params = run_mixprec(**GRADSCALER_RULE, growth_interval=1)
    assert scales == torch_scales
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params))
    assert max(scales) == 2.0**28 and min(scales) == 2.0**-102  # past 2**24, below 1
    reference = torch.amp.GradScaler("cpu")
    rule = DynamicLossScale(**GRADSCALER_RULE)
    assert (rule.initial_scale, rule.growth_factor, rule.backoff_factor, rule.growth_interval) == (
        reference.get_scale(), reference.get_growth_factor(), reference.get_backoff_factor(),
        reference.get_growth_interval(),
    )  # fmt: skip


def test_the_default_rule_differs_where_the_guide_says():
    """Start 2**15, ceiling 2**24, floor 1, and 100 overflows in a row at the floor raise."""
    with pytest.raises(ScaleCollapseError):
        run_mixprec(growth_interval=1)
    scales, _ = run_mixprec(growth_interval=1, collapse_after=None)
    assert scales[0] == 2.0**16 and max(scales) == 2.0**24 and min(scales) == 1.0


def ema_run(keep_float32: bool, steps: int = 20, decay: float = 0.9999):  # timm's decay
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))  # fmt: skip
    ema = copy.deepcopy(model).requires_grad_(False)  # before initialize: float32
    start = [p.clone() for p in ema.parameters()]
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2",
                                dtype=torch.bfloat16)  # fmt: skip
    if not keep_float32:  # a copy made after initialize: bfloat16 like the model
        ema = copy.deepcopy(model).requires_grad_(False)
        start = [p.clone() for p in ema.parameters()]
    reference = [p.double() for p in start]  # the same average in float64
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.scale_loss(model(torch.randn(8, 16, generator=g)).square().mean()).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            values = [p.to(e.dtype) for p, e in zip(model.parameters(), ema.parameters())]
            torch._foreach_lerp_(list(ema.parameters()), values, 1 - decay)
            for r, p in zip(reference, model.parameters()):
                r.lerp_(p.double(), 1 - decay)
    return list(ema.parameters()), start, reference


def test_an_ema_copy_kept_in_float32_averages_and_a_bfloat16_one_does_not():
    model = torch.nn.Linear(2, 2)
    ema = copy.deepcopy(model).requires_grad_(False)
    model, _ = amp.initialize(model, None, "O2", dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="expected dtype float"):
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.001)  # timm
    averaged, start, reference = ema_run(keep_float32=True)
    assert all(a.dtype == torch.float32 for a in averaged)
    assert all(
        torch.allclose(a.double(), r, rtol=0, atol=1e-6) for a, r in zip(averaged, reference)
    )
    assert 0.999 < travelled(averaged, start, reference) <= 1.001
    # A copy in bfloat16 mostly stands still: 1e-4 of the distance to the model is below
    # half a bfloat16 ulp of most values (measured: 70 of 740 values move, 9 % of the way).
    frozen, start, reference = ema_run(keep_float32=False)
    assert travelled(frozen, start, reference) < 0.2


def travelled(averages, start, reference) -> float:
    """How far ``averages`` moved from ``start``, as a fraction of the exact average's way."""
    way = [(a.double() - s.double()).abs().sum() for a, s in zip(averages, start)]
    exact = [(r - s.double()).abs().sum() for r, s in zip(reference, start)]
    return float(sum(way) / sum(exact))


def test_use_ema_averages_the_float32_masters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))  # fmt: skip
    model, _ = amp.initialize(model, None, "O2", dtype=torch.bfloat16)
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scale=None,
                             master_weights=True, use_ema=True, ema_momentum=0.999)  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        opt.scale_loss(model(torch.randn(8, 16)).square().mean()).backward()
        opt.step()
        opt.zero_grad()
    opt.copy_ema_to_params()
    assert model[0].weight.dtype == torch.bfloat16
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
