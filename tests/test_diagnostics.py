"""mixprec.diagnose and the PrecisionReport: exponent histograms against direct counts,
constructed models with known magnitudes, the loss-scale recommendation, the deny list,
what training at the recommendation does, saving and loading, and bad input."""

from __future__ import annotations

import json
import math
import re

import pytest
import real_models
import torch
from matplotlib.image import imread
from PIL import Image
from torch import nn

import mixprec
from mixprec import DynamicLossScale, LossScaleOptimizer, amp
from mixprec.diagnostics import (
    ExponentCounts,
    ExponentHistogram,
    LayerStats,
    PrecisionReport,
    diagnose,
    dtype_range,
)
from mixprec.diagnostics._scales import choose_scale

F16_MAX_EXPONENT, F16_MIN_NORMAL = 15, 2.0**-14


# -- exponent histograms against direct counts -----------------------------------------


def wide_values(n: int = 20000, seed: int = 0) -> torch.Tensor:
    """Values spread over 2**-40 .. 2**20, with zeros, both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-40, 20, (n,), generator=g).float()
    x[::97] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [-8, 0, 7, 20])
def test_histogram_fractions_are_the_direct_counts(dtype, k):
    x = wide_values() * (2.0**100 if dtype == torch.bfloat16 else 1.0)
    hist = ExponentHistogram(dtype=dtype)
    hist.add(x)
    counts = hist.read()
    scaled = x.double() * 2.0**k
    cast = scaled.to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    direct_under = ((cast.double().abs() < tiny) & (scaled != 0)).double().mean().item()
    direct_over = cast.isinf().double().mean().item()
    direct_flush = ((cast == 0) & (scaled != 0)).double().mean().item()
    assert counts.overflow_fraction(dtype, 2.0**k) == pytest.approx(direct_over, abs=1e-12)
    assert counts.underflow_fraction(dtype, 2.0**k) == pytest.approx(direct_under, abs=1e-12)
    # Flush to zero is exact up to values within one rounding step of the boundary.
    assert counts.flush_fraction(dtype, 2.0**k) == pytest.approx(direct_flush, abs=1e-3)
    assert counts.zero_fraction() == pytest.approx((x == 0).double().mean().item())
    nonzero = x[x != 0].abs()
    assert counts.exponent_range()[0] == math.floor(math.log2(nonzero.min().item()))
    assert counts.total == x.numel()


def test_histogram_counts_nonfinite_float64_and_low_precision_inputs():
    x = torch.tensor([1.0, float("inf"), float("-inf"), float("nan"), 0.0, -3.0])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        hist = ExponentHistogram()
        hist.add(x.to(dtype))
        c = hist.read()
        assert (c.total, c.zeros, c.nonfinite, c.exponents) == (6, 1, 3, {0: 1, 1: 1})
    hist = ExponentHistogram(dtype=torch.float16)
    hist.add(torch.tensor([1e300, 1e-300, 65519.0, 65520.0], dtype=torch.float64))
    c = hist.read()
    assert c.nonfinite == 0 and c.zeros == 0
    assert c.overflow_fraction(torch.float16) == 0.5  # 1e300 and 65520 (rounds to inf)
    assert c.flush_fraction(torch.float16) == 0.25  # 1e-300
    assert ExponentCounts.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_histogram_rejects_what_it_cannot_count():
    with pytest.raises(TypeError, match="floating torch.Tensor"):
        ExponentHistogram().add(torch.arange(3))
    with pytest.raises(ValueError, match="scale must be a positive"):
        ExponentCounts({0: 1}, 0, 0, 1).underflow_fraction(torch.float16, scale=0.0)
    with pytest.raises(ValueError, match="do not add up"):
        ExponentCounts.from_dict({"total": 5, "zeros": 0, "nonfinite": 0, "exponents": {"1": 1}})


def test_dtype_ranges_match_torch_finfo():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        rng, info = dtype_range(dtype), torch.finfo(dtype)
        assert 2.0**rng.min_normal == info.smallest_normal
        assert 2.0**rng.max <= info.max < 2.0 ** (rng.max + 1)
        assert torch.tensor(2.0**rng.min_subnormal).to(dtype) > 0
        assert torch.tensor(2.0 ** (rng.min_subnormal - 2)).to(dtype) == 0


def test_the_scale_covers_the_most_gradients_with_margin():
    choice = choose_scale({"a": (3, 20), "b": (5, 25), "c": (30, 40)}, margin_bits=4)
    assert (choice.exponent, choice.lo, choice.hi, choice.excluded) == (9, 5, 20, ("c",))
    assert choice.margin_bits == (4, 11)
    assert choose_scale({"a": (-math.inf, math.inf)}).exponent == 0  # nothing to fix: 1
    assert choose_scale({"a": (10, 11)}).exponent == 10  # narrow: the midpoint, rounded down
    assert choose_scale({}) is None


# -- constructed models with known magnitudes ------------------------------------------


class Tiny(nn.Module):
    """Gradients ~2**k: the weight enters the output multiplied by 2**k."""

    def __init__(self, width: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x + (2.0**self.k) * self.weight * x


class Big(nn.Module):
    """Activations ~2**17, above float16's largest value; a LayerNorm follows it."""

    def forward(self, x):
        return x * 2.0**17


def constructed(k: int = -30) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 16), Tiny(16, k), nn.Linear(16, 16), Big(), nn.LayerNorm(16), nn.Linear(16, 4)
    )


def batches(n: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
        for _ in range(n)
    ]


LOSS = nn.CrossEntropyLoss(reduction="sum")


def direct_counts(model: nn.Module, data) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor the report counts, gathered without the diagnostics code."""
    seen: dict[tuple[str, str], list[torch.Tensor]] = {}
    modules = dict(model.named_modules())
    for x, y in data:
        outputs: dict[str, torch.Tensor] = {}
        handles = [
            m.register_forward_hook(lambda m, a, out, n=n, seen=outputs: seen.__setitem__(n, out))
            for n, m in modules.items()
            if n
        ]
        model.zero_grad()
        loss = LOSS(model(x), y)
        for out in outputs.values():
            out.retain_grad()
        loss.backward()
        for h in handles:
            h.remove()
        for n, out in outputs.items():
            seen.setdefault((n, "activation"), []).append(out.detach().flatten())
            seen.setdefault((n, "activation_grad"), []).append(out.grad.flatten())
        for n, p in model.named_parameters():
            seen.setdefault((n, "grad"), []).append(p.grad.flatten().clone())
    return {key: torch.cat(v) for key, v in seen.items()}


def f16_under(t: torch.Tensor) -> float:
    return ((t.abs() < F16_MIN_NORMAL) & (t != 0)).double().mean().item()


def f16_over(t: torch.Tensor) -> float:
    return t.half().isinf().double().mean().item()


@pytest.mark.parametrize("k", [-30, -40])
def test_the_report_names_exactly_the_layers_built_to_fail(k):
    report = diagnose(constructed(k), LOSS, batches())
    assert report.at_risk == ("1.weight", "3")
    assert report.overflowing() == ["3"]  # activations above 65504
    # Without scaling: the 2**k gradient, and the gradient behind Big's LayerNorm (~2**-24).
    assert report.underflowing() == ["1.weight", "3"]
    assert "activations overflow float16" in report.reasons["3"][0]
    assert "needs a scale" in report.reasons["1.weight"][0]
    assert report.risky_tensors == {("1.weight", "grad"), ("3", "activation")}
    suggestion = report.suggest()
    assert suggestion.float32_modules == ("1", "3")


def test_fractions_match_a_direct_count_within_one_percent():
    model, data = constructed(), batches()
    report = diagnose(model, LOSS, data)
    direct = direct_counts(model, data)
    checked = 0
    for (name, tensor), values in direct.items():
        layer = report.layers[name].tensors[tensor]
        assert layer.total == values.numel()
        assert layer.underflow_fraction(torch.float16) == pytest.approx(f16_under(values), abs=0.01)
        assert layer.overflow_fraction(torch.float16) == pytest.approx(f16_over(values), abs=0.01)
        checked += 1
    assert checked == len(direct) == 6 * 2 + 9  # 6 modules, 9 parameter gradients
    tiny, big = direct[("1.weight", "grad")], direct[("3", "activation")]
    assert report.layers["1.weight"].underflow_fraction == f16_under(tiny) == 1.0
    assert report.layers["3"].overflow_fraction == pytest.approx(f16_over(big), abs=1e-12)
    assert 0.1 < report.layers["3"].overflow_fraction < 0.5


def test_a_recoverable_underflow_is_cured_by_the_recommended_scale():
    # Gradients of 2**-26..2**-19: the scale that saves them (2**12) is one the others allow.
    report = diagnose(constructed(-20), LOSS, batches())
    assert "1.weight" in report.underflowing()
    assert "1.weight" not in report.at_risk
    scale = report.recommended_loss_scale
    low, high = report.loss_scale_range
    assert low <= scale <= high
    assert report.layers["1.weight"].underflow_at(scale) <= report.tolerance
    assert all(report.layers[n].overflow_at(scale) == 0 for n in report.layers if n != "3")
    below, above = report.margin
    assert 2.0**below * low == scale == high / 2.0**above


def test_bfloat16_needs_no_scale():
    report = diagnose(constructed(-8), LOSS, batches(), dtype="bf16")
    assert report.recommended_loss_scale == 1.0
    assert report.at_risk == ()
    assert report.suggest().kwargs == {"loss_scale": "none"}


def test_inputs_out_of_range_are_a_note_not_a_layer():
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    report = diagnose(net, lambda out, y: out.square().mean(), [(torch.full((2, 4), 7e4), None)])
    assert report.notes and "model inputs: 100.00% of them overflow float16" in report.notes[0]
    assert "normalise the data" in str(report) and report.suggest().notes == tuple(report.notes)


def fp16_skips(model: nn.Module, deny, loss_scale, steps: int = 100) -> int:
    for name in deny:
        amp.to_float(model.get_submodule(name), torch.float32)
    model, opt = amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        "O2",
        torch.float16,
        loss_scale=loss_scale,
    )
    data = batches(5, seed=2)
    for step in range(steps):
        x, y = data[step % len(data)]
        opt.scale_loss(LOSS(model(x).float(), y)).backward()
        opt.step()
        opt.zero_grad()
    return int(opt.skipped_steps)


def test_training_at_the_recommendation_skips_fewer_steps_than_the_default_start(one_thread):
    report = diagnose(constructed(), LOSS, batches())
    suggestion = report.suggest()
    # Both runs keep the layers at risk in float32; only the starting scale differs.
    default = fp16_skips(constructed(), suggestion.float32_modules, DynamicLossScale())
    recommended = fp16_skips(
        constructed(), suggestion.float32_modules, suggestion.kwargs["loss_scale"]
    )
    # skipped steps in the first 100 (float16 O2), from the default 2**15 start and the report's
    assert recommended < default, (default, recommended, report.recommended_loss_scale)
    assert report.overflowing(2.0**15)  # the report says why the default start skips


# -- the model is left as it was; bad input ----------------------------------------------


def test_diagnose_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net[0].weight.grad = torch.full_like(net[0].weight, 3.0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = [(torch.randn(16, 4), torch.randint(0, 2, (16,)))]
    diagnose(net, nn.functional.cross_entropy, data)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(net[0].weight.grad, torch.full_like(net[0].weight, 3.0))
    assert net[2].weight.grad is None
    assert not net[0]._forward_hooks and not net._forward_pre_hooks


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model": "net"}, TypeError, "model must be a torch.nn.Module"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
        ({"dtype": torch.float32}, ValueError, "dtype must be torch.float16 or torch.bfloat16"),
        ({"batches": torch.ones(3)}, TypeError, "batches must be an iterable"),
        ({"batches": []}, ValueError, "batches yielded no batch"),
        (
            {"batches": [torch.ones(2, 4)]},
            ValueError,
            r"batches\[0\] must be an \(inputs, target\) pair or a dict of the model's",
        ),
        ({"loss_fn": lambda o, y: o}, ValueError, "loss_fn must return a one-element tensor"),
        ({"tolerance": 2}, ValueError, "tolerance must be a number in"),
        ({"max_batches": 0}, ValueError, "max_batches must be an integer >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, error, match):
    net = nn.Linear(4, 2)
    args = {
        "model": net,
        "loss_fn": nn.functional.cross_entropy,
        "batches": [(torch.randn(3, 4), torch.tensor([0, 1, 0]))],
        **kwargs,
    }
    with pytest.raises(error, match=match):
        diagnose(args.pop("model"), args.pop("loss_fn"), args.pop("batches"), **args)
    assert net.weight.grad is None


def test_a_hugging_face_model_is_diagnosed_from_its_dict_batches():
    """A Hugging Face batch is a dict of the model's keyword arguments, labels included:
    ``model(**batch)``, and the loss function gets the batch as its target (here it
    takes the model's own loss). A pair of (keyword inputs, target) reads the same
    histograms as a pair of (positional inputs, target)."""
    no_dropout = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0)
    model = real_models.gpt2(layers=1, width=16, **no_dropout)  # the same values each run
    ids, targets = real_models.char_batches(batch=2, length=8, steps=1)[0]

    def logits_loss(out, labels):
        return real_models.lm_loss(out.logits, labels)

    as_dict = diagnose(model, lambda out, batch: out.loss, [{"input_ids": ids, "labels": ids}])
    as_pair = diagnose(model, logits_loss, [({"input_ids": ids}, targets)])
    positional = diagnose(model, logits_loss, [((ids,), targets)])
    assert as_pair.layers and set(as_dict.layers) == set(as_pair.layers) == set(positional.layers)
    for name, stats in positional.layers.items():
        assert as_pair.layers[name].exponent_range == stats.exponent_range, name
        assert as_pair.layers[name].underflow_fraction == stats.underflow_fraction, name


def test_a_frozen_model_has_nothing_to_diagnose():
    net = nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="does not depend on any parameter"):
        diagnose(net, nn.functional.cross_entropy, [(torch.randn(3, 4), torch.tensor([0, 1, 0]))])


# -- output: table, JSON, PNG; suggestions in use --------------------------------------


def test_save_writes_json_and_png_that_load_back(tmp_path):
    report = diagnose(constructed(), LOSS, batches(2))
    json_path, png_path = report.save(tmp_path / "out")
    assert json_path.name == "precision_report.json" and png_path.name == "precision_report.png"
    data = json.loads(json_path.read_text())
    assert data["recommended_loss_scale"] == report.recommended_loss_scale
    assert list(data["at_risk"]) == list(report.at_risk)
    assert data["layers"]["3"]["overflow_fraction"] == report.layers["3"].overflow_fraction
    loaded = PrecisionReport.load(tmp_path / "out")
    assert loaded.to_dict() == report.to_dict() and str(loaded) == str(report)
    pixels = imread(png_path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and float(pixels.std()) > 0.01
    plotted = json.loads(Image.open(png_path).text["mixprec-data"])
    risky = {row["label"] for row in plotted["rows"] if row["at_risk"]}
    assert risky == {"1.weight grad", "3 activation"}
    assert plotted["normal"] == [-14, 15]
    with pytest.raises(ValueError, match="is a file"):
        report.save(json_path)
    with pytest.raises(ValueError, match="not a precision report"):
        PrecisionReport.from_dict({"dtype": "float16"})


def test_the_table_names_layers_scale_and_risk():
    text = str(diagnose(constructed(), LOSS, batches(2)))
    assert "loss scale: recommended 2^11 = 2048" in text
    assert "keep in float32" in text
    assert re.search(r"\n  3: \d+\.\d\d% of its activations overflow float16 \(up to 2\^17\)", text)
    row = next(
        line for line in text.splitlines() if line.startswith("3 ") and "activation " in line
    )
    assert row.rstrip().endswith("AT RISK")


def test_suggestion_kwargs_work_with_amp_initialize_and_the_optimizer():
    report = diagnose(constructed(), LOSS, batches(2))
    suggestion = report.suggest()
    model = constructed()
    for name in suggestion.float32_modules:
        amp.to_float(model.get_submodule(name), torch.float32)
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.float16, **suggestion.kwargs
    )
    assert float(opt.loss_scale) == report.recommended_loss_scale == 2048.0
    assert model[3].__class__ is Big and model[0].weight.dtype == torch.float16
    plain = LossScaleOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters()), **suggestion.kwargs)
    assert float(plain.loss_scale) == 2048.0
    assert "keep in float32: 1, 3" in str(suggestion)


def test_layer_stats_check_their_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        LayerStats("x", "buffer", torch.float16, {})
    with pytest.raises(ValueError, match="a parameter has histograms"):
        LayerStats("x", "parameter", torch.float16, {"activation": ExponentCounts.empty()})


def test_top_level_name():
    assert mixprec.diagnose is diagnose and "diagnose" in mixprec.__all__


def test_rows_of_many_tensors_count_as_each_tensor_alone():
    from mixprec.diagnostics._histogram import NUM_BINS, count_exponents_, count_exponents_rows_

    tensors = [wide_values(n, seed=n) for n in (5, 0, 300, 1, 2000, 17)]
    tensors[3] = torch.zeros(1)
    for chunk in (1, 64, 1 << 24):  # one tensor per chunk, several, all in one
        rows = torch.zeros(len(tensors), NUM_BINS, dtype=torch.int64)
        count_exponents_rows_(rows, [t.bfloat16() for t in tensors], torch.float16, chunk)
        for row, t in zip(rows, tensors):
            alone = torch.zeros(NUM_BINS, dtype=torch.int64)
            count_exponents_(alone, t.bfloat16(), torch.float16)
            assert torch.equal(row, alone)
    assert int(rows[1].sum()) == 0 and int(rows[3, -1]) == 1
    with pytest.raises(ValueError, match="counts must have shape"):
        count_exponents_rows_(torch.zeros(2, NUM_BINS, dtype=torch.int64), tensors)
