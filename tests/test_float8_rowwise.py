"""The rowwise float8 recipes (``"rowwise"``, ``"rowwise_with_gw_hp"``): against torchao's
rowwise numerics, against float32, through conversion, checkpoints and statistics."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_float8 import (
    test_compiled_training_step_equals_eager_without_graph_breaks as compiled_step_equals_eager,
)
from torch import nn

from mixprec import amp
from mixprec.amp._initialize import check_fp8
from mixprec.float8 import (
    Float8Conv1D,
    Float8Linear,
    RowwiseScaling,
    RowwiseWithGwHpScaling,
    _matmul,
    convert_from_float8,
    convert_to_float8,
    float8_stats,
    make_scaling,
    native_scaled_mm,
    read_float8_stats,
    scaled_mm,
)

ROWWISE = ["rowwise", "rowwise_with_gw_hp"]
ALL_RECIPES = ["dynamic", "delayed", *ROWWISE]


@pytest.fixture
def emulated(monkeypatch):
    """Run every float8 matmul through the float32 emulation, as torchao's ``emulate=True``."""
    monkeypatch.setitem(_matmul._PROBED, "cpu", False)


def inputs_with_outlier(shape=(2, 20, 64), seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    x.view(-1, shape[-1])[3] *= 300.0  # one token far larger than the rest
    return x


def run(layer, x, seed=1):
    """Forward and backward with a random upstream gradient: output and all gradients."""
    x = x.clone().requires_grad_()
    y = layer(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    (y * g).sum().backward()
    grad_b = None if layer.bias is None else layer.bias.grad
    return {"y": y.detach(), "grad_x": x.grad, "grad_w": layer.weight.grad, "grad_b": grad_b,
            "g": g}  # fmt: skip


def torchao_layer(linear, recipe, emulate):
    config_mod = pytest.importorskip("torchao.float8.config")
    linear_mod = pytest.importorskip("torchao.float8.float8_linear")
    config = config_mod.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate)
    return linear_mod.Float8Linear.from_float(copy.deepcopy(linear), config=config)


# -- against torchao -------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ROWWISE)
def test_matches_torchao_bit_for_bit_when_both_emulate(recipe, emulated):
    # Both emulate the float8 matmuls in float32 from the same float8 values and
    # power-of-two scales (exact to apply), so every result is the same float.
    linear = nn.Linear(64, 48)
    x = inputs_with_outlier()
    ours = run(Float8Linear.from_linear(copy.deepcopy(linear), recipe=recipe), x)
    theirs = run(torchao_layer(linear, recipe, emulate=True), x)
    for name in ("y", "grad_x", "grad_w", "grad_b"):
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("recipe", ROWWISE)
def test_native_scaled_mm_agrees_with_torchao_up_to_float32_sums(recipe):
    if not native_scaled_mm("cpu"):
        pytest.skip("this CPU has no float8 matmul kernel")
    linear = nn.Linear(64, 48)
    x = inputs_with_outlier()
    ours = run(Float8Linear.from_linear(copy.deepcopy(linear), recipe=recipe), x)
    theirs = run(torchao_layer(linear, recipe, emulate=True), x)
    for name in ("y", "grad_x", "grad_w", "grad_b"):
        # The kernel and the emulation differ only in the order of float32 sums.
        scale = theirs[name].abs().max()
        assert (ours[name] - theirs[name]).abs().max() <= 1e-5 * scale, name


def test_the_recipes_follow_torchaos_cast_table():
    pytest.importorskip("torchao")
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType

    for recipe, ours in (("rowwise", RowwiseScaling), ("rowwise_with_gw_hp", RowwiseWithGwHpScaling)):
        c = Float8LinearConfig.from_recipe_name(recipe)
        assert c.round_scales_to_power_of_2 and ours().power_of_2
        casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
        assert {cc.target_dtype for cc in casts} == {torch.float8_e4m3fn}
        assert all(cc.scaling_granularity is ScalingGranularity.AXISWISE for cc in casts)
        hp = c.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
        assert hp == ours.grad_weight_hp
        layer = Float8Linear(16, 16, recipe=recipe)
        dtypes = {s.fp8_dtype for s in (layer.input_scaling, layer.weight_scaling,
                                        layer.grad_scaling)}  # fmt: skip
        assert dtypes == {torch.float8_e4m3fn}


# -- the casts -------------------------------------------------------------------------


def test_each_row_gets_its_own_power_of_two_scale():
    x = torch.tensor([[1.0, -3.0, 0.5], [0.01, 0.02, 0.0], [0.0, 0.0, 0.0]])
    data, inv = RowwiseScaling().cast(x)
    amax = x.abs().amax(1, keepdim=True).clamp(min=1e-12)
    expected = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    assert torch.equal(inv, expected.reciprocal())
    # Each row's amax lands in (224, 448]: the whole e4m3 range is used by every row.
    scaled = data.float()[:2].abs().amax(1)
    assert torch.all((scaled > 224) & (scaled <= 448))
    # Undoing the scale gives x to e4m3's rounding (2^-4 relative), row by row.
    assert torch.all((data.float() * inv - x).abs() <= 2.0**-4 * x.abs())


def test_power_of_2_false_gives_the_exact_scale():
    x = torch.tensor([[3.0, 1.0], [0.3, 0.1]])
    data, inv = RowwiseScaling(power_of_2=False).cast(x)
    assert torch.allclose(inv.flatten(), torch.tensor([3.0, 0.3]) / 448.0)
    assert torch.equal(data.float().abs().amax(1), torch.tensor([448.0, 448.0]))


def test_a_non_finite_row_becomes_nan_and_counts_an_overflow():
    s = RowwiseScaling()
    x = torch.tensor([[1.0, float("inf")], [2.0, 4.0], [float("nan"), 1.0]])
    data, inv = s.cast(x)
    assert torch.isnan(data.float()[0, 1]) and torch.isnan(data.float()[2]).all()
    assert torch.equal(data.float()[1] * inv[1], x[1])  # the other row is untouched
    assert s.overflows == 1 and torch.isnan(s.amax)
    y = scaled_mm(data, data.t(), inv, inv.t(), torch.float32)
    assert torch.isnan(y[0, 0]) and torch.isfinite(y[1, 1])  # the loss scale will see it


def test_statistics_describe_the_whole_tensor():
    layer = Float8Linear(32, 16, recipe="rowwise", bias=False)
    x = inputs_with_outlier((6, 32))
    run(layer, x)
    stats = float8_stats(layer)[""]
    assert stats["amax_input"] == x.abs().max()
    assert stats["amax_weight"] == layer.weight.abs().max()
    assert stats["scale_input"] == torch.exp2(torch.floor(torch.log2(448.0 / x.abs().max())))
    assert stats["amax_grad"] > 0 and stats["saturated_fraction_input"] == 0
    assert read_float8_stats(layer)[""]["overflows_grad"] == 0.0


def test_scaled_mm_takes_per_row_and_mixed_scales():
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(24, 32).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(16, 1) + 0.5, torch.rand(1, 24) + 0.5
    exact = a.double() @ b.double()
    for scale_a, scale_b in ((sa, sb), (sa, torch.tensor(0.5)), (torch.tensor(2.0), sb),
                             (sa.t().contiguous().t(), sb)):  # fmt: skip
        y = scaled_mm(a, b, scale_a, scale_b, torch.float32)
        ref = exact * scale_a.double() * scale_b.double()
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)


# -- accuracy --------------------------------------------------------------------------


def test_rowwise_keeps_the_rows_beside_an_outlier_accurate():
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    x[0] *= 1e5
    linear = nn.Linear(64, 32, bias=False)
    exact = linear(x).detach()[1:]
    errors = {}
    for recipe in ALL_RECIPES:
        y = Float8Linear.from_linear(copy.deepcopy(linear), recipe=recipe)(x).detach()[1:]
        errors[recipe] = float((y - exact).norm() / exact.norm())
    assert errors["rowwise"] < 0.1 and errors["rowwise_with_gw_hp"] < 0.1
    assert errors["dynamic"] > 5 * errors["rowwise"]


def test_the_high_precision_weight_gradient_is_the_float32_one():
    linear = nn.Linear(64, 48)
    x = inputs_with_outlier()
    out = run(Float8Linear.from_linear(copy.deepcopy(linear), recipe="rowwise_with_gw_hp"), x)
    expected = out["g"].reshape(-1, 48).t() @ x.reshape(-1, 64)
    assert torch.allclose(out["grad_w"], expected, rtol=1e-6, atol=1e-4)


def train(recipe, steps=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    if recipe:
        assert convert_to_float8(model, recipe).converted == ["0", "2"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(64, 32, generator=gen), torch.randn(64, 16, generator=gen)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), target))


@pytest.mark.parametrize("recipe", ROWWISE)
def test_training_follows_float32(recipe):
    reference, start = train(None), train(None, steps=0)
    final = train(recipe)
    assert final < 0.9 * start  # it learns
    assert abs(final - reference) < 0.03 * reference


@pytest.mark.parametrize("recipe", ROWWISE)
def test_compiled_step_equals_eager_without_graph_breaks(recipe):
    # The per-tensor recipes' check, run on the rowwise ones: no graph break, and the
    # compiled losses, gradients and scaling state equal eager's.
    compiled_step_equals_eager(recipe)


# -- layers, conversion, checkpoints ---------------------------------------------------


@pytest.mark.parametrize("recipe", ROWWISE)
def test_conv1d_runs_the_same_matmuls_as_linear(recipe):
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    conv = conv1d(48, 64)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    x = inputs_with_outlier()
    a = run(Float8Conv1D.from_conv1d(conv, recipe=recipe), x)
    b = run(Float8Linear.from_linear(linear, recipe=recipe), x)
    assert torch.equal(a["y"], b["y"]) and torch.equal(a["grad_x"], b["grad_x"])
    assert torch.equal(a["grad_w"], b["grad_w"].t())


@pytest.mark.parametrize("recipe", ROWWISE)
def test_convert_state_dict_and_back(recipe):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    model = copy.deepcopy(plain)
    report = convert_to_float8(model, recipe)
    assert report.recipe == recipe and report.converted == ["0"]
    assert model[0].recipe == recipe and type(model[0].input_scaling).kind == recipe
    x = torch.randn(4, 32)
    model(x).sum().backward()
    # A float8 checkpoint resumes into a fresh float8 model of the same recipe.
    again = copy.deepcopy(plain)
    convert_to_float8(again, recipe)
    again.load_state_dict(model.state_dict())
    assert torch.equal(again(x), model(x))
    assert float8_stats(again)["0"]["amax_input"] == x.abs().max()
    # A plain checkpoint loads strictly into the float8 model, and back to plain.
    model.load_state_dict(plain.state_dict())
    back = convert_from_float8(model)
    assert type(back[0]) is nn.Linear and back.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(back(x), plain(x))


@pytest.mark.parametrize("recipe", ROWWISE)
def test_amp_initialize_takes_the_rowwise_names(recipe):
    assert check_fp8(recipe) == recipe
    model = nn.Sequential(nn.Linear(16, 16))
    amp.initialize(model, level="O0", fp8=recipe)
    assert isinstance(model[0], Float8Linear) and model[0].recipe == recipe
    model(torch.randn(3, 16)).sum().backward()
    assert model[0].weight.grad is not None


def test_inputs_without_gradients_and_frozen_weights():
    layer = Float8Linear(32, 16, recipe="rowwise")
    layer.weight.requires_grad_(False)
    x = torch.randn(5, 32, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is None
    layer.weight.requires_grad_(True)
    layer(torch.randn(0, 32)).sum().backward()  # no tokens: a zero weight gradient
    assert torch.equal(layer.weight.grad, torch.zeros(16, 32))


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: Float8Linear(16, 16, recipe="row_wise"),
    lambda: make_scaling("rowwise_gw_hp", "e4m3"),
    lambda: convert_to_float8(nn.Linear(16, 16), "Rowwise"),
    lambda: amp.initialize(nn.Linear(16, 16), level="O0", fp8="rowwize"),
])  # fmt: skip
def test_a_bad_recipe_name_is_refused_naming_the_choices(make):
    with pytest.raises(ValueError, match="'rowwise', 'rowwise_with_gw_hp'"):
        make()


def test_a_bad_option_and_a_mixed_layer_are_refused():
    with pytest.raises(ValueError, match="history_len is not an option of recipe='rowwise'"):
        Float8Linear(16, 16, recipe="rowwise", history_len=4)
    layer = Float8Linear(16, 16, recipe="rowwise")
    layer.grad_scaling = make_scaling("dynamic", "e5m2")
    with pytest.raises(TypeError, match="rowwise scalings"):
        layer(torch.randn(2, 16))
    with pytest.raises(ValueError, match="0-d"):
        RowwiseScaling().cast(torch.tensor(1.0))
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="eps must be"):
        convert_to_float8(model, "rowwise", eps=-1.0)
    with pytest.raises(ValueError, match="pass a larger eps"):
        convert_to_float8(model, "rowwise", eps=1e-40)
    assert type(model[0]) is nn.Linear  # nothing changed


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_of_2", [True, False])
def test_a_rowwise_cast_needs_no_clamp_every_row_lands_within_the_float8_range(fp8, power_of_2):
    # Each row's scale comes from that row's own amax, so x * scale exceeds fp8_max by
    # float32 rounding at most, which the cast rounds back: the same float8 values as a
    # clamped cast, and no inf or NaN, over rows whose magnitudes span float32's range.
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.exp2(torch.randint(-30, 120, (4096, 1), generator=gen).float())  # > eps
    x = torch.randn(4096, 33, generator=gen) * magnitudes
    x[::7, 5] = x[::7].abs().amax(1) * torch.rand(x[::7].shape[0], generator=gen)  # ties
    scaling = RowwiseScaling(fp8, power_of_2=power_of_2)
    cast = scaling._cast_along(x, -1)
    clamped = (x * cast.scale).clamp(-scaling.fp8_max, scaling.fp8_max).to(scaling.fp8_dtype)
    assert torch.equal(cast.data.view(torch.uint8), clamped.view(torch.uint8))
    assert bool(cast.data.float().isfinite().all())
    if not power_of_2:  # each row's amax lands on fp8_max itself
        assert bool((cast.data.float().abs().amax(1) == scaling.fp8_max).all())
