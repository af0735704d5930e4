"""Float8 training (``mixprec.float8``): scaling state machines, ``Float8Linear``,
``convert_to_float8`` and the per-layer statistics, against float32 references and a
plain-Python model of the recipes. Shapes are tiny: float8 matmuls are emulated on CPUs."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from mixprec.float8 import (
    DelayedScaling,
    DynamicScaling,
    Float8Linear,
    Float8Scaling,
    convert_to_float8,
    float8_stats,
    make_scaling,
    read_float8_stats,
)
from mixprec.tools import HostSyncCounter
from mixprec.train.models import TransformerClassifier

E4M3 = {"u": 2.0**-4, "tiny": 2.0**-10, "max": 448.0}  # unit roundoff, half the least subnormal
E5M2 = {"u": 2.0**-3, "tiny": 2.0**-17, "max": 57344.0}
RECIPES = ["dynamic", "delayed"]


# -- the error bound ---------------------------------------------------------------------


def product_bound(a, b, fa, fb, scale_a, scale_b):
    """Bound on ``|(a_hat @ b_hat) - (a @ b)|`` elementwise, for float8 copies of ``a``, ``b``.

    A float8 cast with scale ``s`` rounds each scaled element to nearest: in the normal
    range the relative error is at most the unit roundoff ``u`` (2^-4 for e4m3's 3
    mantissa bits, 2^-3 for e5m2's 2), and below it the absolute error is at most half
    the least subnormal (2^-10 for e4m3, 2^-17 for e5m2). Undoing the scale, each
    element satisfies ``|a_hat - a| <= u_a |a| + t_a`` with ``t_a = tiny_a / s_a``
    (no element is clipped: checked by the callers). For one product,

        |a_hat b_hat - a b| <= |a_hat| |b_hat - b| + |a_hat - a| |b|
                             <= (u_a + u_b + u_a u_b) |a||b| + (1 + u_a) t_b |a|
                                + (1 + u_b) t_a |b| + t_a t_b,

    and summing over the K terms of a dot product adds the float32 accumulation and
    output rounding, at most (K + 1) 2^-24 sum |a_hat||b_hat| with
    ``|a_hat| <= (1 + u_a)|a| + t_a``. So the bound is about (u_a + u_b) sum |a||b|:
    2^-3 of sum |x||w| for the forward, 3 * 2^-4 for both gradients.
    """
    ua, ub = fa["u"], fb["u"]
    ta, tb = fa["tiny"] / float(scale_a), fb["tiny"] / float(scale_b)
    abs_a, abs_b = a.abs().double(), b.abs().double()
    k = a.shape[1]
    bound = (ua + ub + ua * ub) * (abs_a @ abs_b)
    bound += (1 + ua) * tb * abs_a.sum(1, keepdim=True) + (1 + ub) * ta * abs_b.sum(0)
    bound += k * ta * tb
    bound += (k + 1) * 2.0**-24 * (((1 + ua) * abs_a + ta) @ ((1 + ub) * abs_b + tb))
    return bound


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_and_both_gradients_are_within_the_derived_bound_of_float32(recipe):
    """Forward ``x @ W^T`` (e4m3 x e4m3), ``grad_x = g @ W`` (e5m2 x e4m3) and
    ``grad_W = g^T @ x`` (e5m2 x e4m3) each lie within :func:`product_bound` of the
    float32 result; the bound is not vacuous: the errors are nonzero, reach a visible
    part of it, and exceed those of the same matmuls in bfloat16 (8 mantissa bits)."""
    torch.manual_seed(0)
    layer = Float8Linear(64, 32, recipe=recipe)
    x = torch.randn(24, 64, requires_grad=True)
    g = torch.randn(24, 32)
    if recipe == "delayed":  # a first step with larger values: this one uses the history
        layer(1.5 * x.detach()).backward(1.5 * g)
        layer.zero_grad()
    y = layer(x)
    y.backward(g)
    for scaling in (layer.input_scaling, layer.weight_scaling, layer.grad_scaling):
        assert int(scaling.saturated) == 0
    w = layer.weight.detach()
    xd = x.detach()
    s_x, s_w, s_g = layer.input_scaling.scale, layer.weight_scaling.scale, layer.grad_scaling.scale
    bias = layer.bias.detach()
    cases = [  # (float8 result, float32 reference, bfloat16 result, bound)
        (y.detach() - bias, xd @ w.t(), (xd.bfloat16() @ w.t().bfloat16()).float(),
         product_bound(xd, w.t(), E4M3, E4M3, s_x, s_w)),
        (x.grad, g @ w, (g.bfloat16() @ w.bfloat16()).float(),
         product_bound(g, w, E5M2, E4M3, s_g, s_w)),
        (layer.weight.grad, g.t() @ xd, (g.t().bfloat16() @ xd.bfloat16()).float(),
         product_bound(g.t(), xd, E5M2, E4M3, s_g, s_x)),
    ]  # fmt: skip
    for got, ref, bf16, bound in cases:
        err = (got.double() - ref.double()).abs()
        assert bool((err <= bound).all()), float((err / bound).max())
        assert float(err.max()) > 0
        assert float((err / bound).max()) > 0.1  # the bound is within 10x of reality
        assert float(err.mean()) > 2 * float((bf16.double() - ref.double()).abs().mean())
    assert torch.equal(layer.bias.grad, g.sum(0))  # the bias gradient is exact (float32)


# -- the scaling state machines ------------------------------------------------------------


class ReferenceScaling:
    """The recipes in plain Python (floats and lists), one cast at a time."""

    def __init__(self, kind, fmt, history_len=16, algo="max", margin=0.0, power_of_2=False):
        self.kind, self.fmt, self.algo = kind, fmt, algo
        self.margin, self.power_of_2 = margin, power_of_2
        self.history = [0.0] * history_len
        self.scale, self.overflows = 1.0, 0
        self.threshold = {448.0: 464.0, 57344.0: 61440.0}[fmt["max"]]

    def cast(self, values):
        amax = math.nan if any(math.isnan(v) for v in values) else max(abs(v) for v in values)
        finite = math.isfinite(amax)
        if self.kind == "dynamic":
            basis = max(amax, 1e-12)
        else:
            past = max(self.history) if self.algo == "max" else self.history[0]
            basis = past if past > 0 else (amax if finite else 0.0)
        if math.isfinite(basis) and basis > 0:
            scale = self.fmt["max"] / basis / 2.0**self.margin
            self.scale = 2.0 ** math.floor(math.log2(scale)) if self.power_of_2 else scale
        saturated = sum(
            1 for v in values if math.isfinite(v) and abs(v * self.scale) > self.threshold
        )
        if self.kind == "delayed":
            self.history = [amax if finite else 0.0] + self.history[:-1]
        self.overflows += not finite
        return saturated


SEQUENCE = [  # amaxes: ordinary, zeros, a spike, an inf, a nan, small again, rollover
    [1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -1.5], [300.0, 1.0, -0.1],
    [1.0, math.inf, 2.0], [0.5, 0.1, math.nan], [0.3, -0.2, 0.1], [1.5, 0.1, 0.2],
    [0.2, 0.2, 0.2], [0.7, -3.0, 0.0], [0.1, 0.05, 0.01], [2.5, 0.5, -0.5],
]  # fmt: skip
SCALINGS = [
    ("delayed", E4M3, {"history_len": 4}),
    ("delayed", E4M3, {"history_len": 3, "amax_compute_algo": "most_recent"}),
    ("delayed", E5M2, {"history_len": 5, "margin": 1.0, "power_of_2": True}),
    ("dynamic", E4M3, {}),
    ("dynamic", E5M2, {"power_of_2": True, "margin": 2.0}),
]


@pytest.mark.parametrize("kind,fmt,options", SCALINGS, ids=lambda v: str(v))
def test_state_machine_follows_the_plain_python_reference_one_cast_at_a_time(kind, fmt, options):
    name = "e4m3" if fmt is E4M3 else "e5m2"
    scaling = make_scaling(kind, name, **options)
    ref = ReferenceScaling(kind, fmt, **{("algo" if k == "amax_compute_algo" else k): v
                                         for k, v in options.items()})  # fmt: skip
    for values in SEQUENCE:
        saturated = ref.cast(values)
        x = torch.tensor(values)
        data, inv = scaling.cast(x)
        assert float(scaling.scale) == pytest.approx(ref.scale, rel=1e-6)
        assert int(scaling.saturated) == saturated
        # Only a recipe that can clip counts (dynamic puts the amax at the maximum).
        assert int(scaling.numel) == (len(values) if scaling.clips else 0)
        assert int(scaling.overflows) == ref.overflows
        if kind == "delayed":
            assert scaling.amax_history.tolist() == pytest.approx(ref.history, rel=1e-6)
            assert bool(torch.isfinite(scaling.amax_history).all())  # never poisoned
        # Dequantised values: clipped into range, non-finite inputs become nan.
        back = data.float() * inv
        finite = torch.isfinite(x)
        limit = fmt["max"] / ref.scale
        expected = x.clamp(-limit, limit)
        assert torch.allclose(
            back[finite], expected[finite], rtol=fmt["u"], atol=1e-30 + limit * 2**-8
        )
        assert bool(back[~finite].isnan().all())


def test_saturation_counts_exactly_the_clipped_elements():
    scaling = DelayedScaling("e4m3", history_len=2)
    scaling.cast(torch.tensor([1.0]))  # history [1]: the next scale is 448
    x = torch.tensor([0.5, 1.0, 1.03, 1.04, 2.0, -3.0, math.inf, math.nan, -1.04, 0.0])
    data, inv = scaling.cast(x)
    # scaled: 224, 448, 461.4 (rounds to 448: not clipped), 465.9, 896, -1344, inf, nan, -465.9
    assert float(scaling.scale) == 448.0
    assert int(scaling.saturated) == 4 and int(scaling.numel) == 10
    assert float(scaling.saturated_fraction()) == pytest.approx(0.4)
    assert (data.float() * inv)[[3, 4, 5, 8]].tolist() == [1.0, 1.0, -1.0, -1.0]
    assert int(scaling.overflows) == 1 and scaling.amax_history.tolist() == [0.0, 1.0]
    grads = DelayedScaling("e5m2", history_len=1)
    grads.cast(torch.tensor([1.0]))
    grads.cast(torch.tensor([1.07, 1.08, -1.1, 0.5]))  # 61358 stays, 61931 and 63078 clip
    assert int(grads.saturated) == 2
    # Dynamic scaling puts the amax at the maximum: float rounding never counts as clipping.
    dynamic = DynamicScaling()
    dynamic.cast(torch.tensor([0.19100171327590942, 0.1]))  # 0.191 * (448 / 0.191) > 448 in f32
    assert int(dynamic.saturated) == 0


def test_config_round_trips_for_every_scaling_and_bad_options_are_refused():
    for scaling in (DynamicScaling("e5m2", margin=1, power_of_2=True, eps=1e-6),
                    DelayedScaling(history_len=7, amax_compute_algo="most_recent")):  # fmt: skip
        again = type(scaling).from_config(scaling.get_config())
        assert again.get_config() == scaling.get_config()
        assert set(scaling.get_config()) >= {"fp8_dtype", "margin", "power_of_2"}
    assert "amax_history" in DelayedScaling().state_dict()
    with pytest.raises(ValueError, match="history_len must be an integer >= 1, got 0"):
        DelayedScaling(history_len=0)
    with pytest.raises(ValueError, match="amax_compute_algo must be one of 'max', 'most_recent'"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="fp8_dtype must be torch.float8_e4m3fn"):
        DynamicScaling(torch.float16)
    with pytest.raises(ValueError, match="recipe must be one of 'dynamic', 'delayed'"):
        make_scaling("static", "e4m3")
    with pytest.raises(ValueError, match="eps is not an option of recipe='delayed'"):
        make_scaling("delayed", "e4m3", eps=1e-3)
    with pytest.raises(ValueError, match="does not take"):
        DynamicScaling.from_config({"history_len": 3})
    scaling = DelayedScaling()
    before = {k: v.clone() for k, v in scaling.state_dict().items()}
    with pytest.raises(TypeError, match="x must be a float32"):
        scaling.cast(torch.arange(3))
    assert all(torch.equal(before[k], v) for k, v in scaling.state_dict().items())
    assert isinstance(make_scaling(scaling, "e5m2"), DelayedScaling)


def test_a_training_step_never_syncs_with_the_host():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8(model, "delayed")
    x = torch.randn(4, 16)
    with HostSyncCounter() as syncs:
        model(x).square().mean().backward()
        float8_stats(model)
    assert syncs.count == 0
    with HostSyncCounter() as syncs:
        read_float8_stats(model)
    assert syncs.count <= 1  # one read for the whole model (none counted for CPU tensors)


# -- Float8Linear --------------------------------------------------------------------------


def test_three_dimensional_inputs_odd_row_counts_and_output_dtypes():
    torch.manual_seed(0)
    layer = Float8Linear(32, 16, bias=False)
    x = torch.randn(3, 5, 32, requires_grad=True)  # 15 rows: grad_W pads them to 16
    y = layer(x)
    ref = x.detach() @ layer.weight.detach().t()
    assert y.shape == (3, 5, 16) and y.dtype == torch.float32
    assert float((y.detach() - ref).abs().max()) < 0.2 * float(ref.abs().max())
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (16, 32)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert Float8Linear(32, 16, output_dtype="bf16")(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 32\), got \(3, 5, 31\)"):
        layer(torch.randn(3, 5, 31))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 inputs, got torch.float64"):
        layer(x.double())
    with pytest.raises(ValueError, match="output_dtype must be one of"):
        Float8Linear(32, 16, output_dtype=torch.float64)


def test_state_dict_round_trip_resumes_bit_exactly():
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        convert_to_float8(model, "delayed", history_len=4)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(8, 16, generator=gen)
            opt.zero_grad()
            F.mse_loss(model(x), x.flip(1)).backward()
            opt.step()

    model, opt = build(0)
    train(model, opt, 3, seed=1)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert "0.grad_scaling.amax_history" in saved[0] and "2.input_scaling.scale" in saved[0]
    train(model, opt, 3, seed=2)
    resumed, resumed_opt = build(5)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    train(resumed, resumed_opt, 3, seed=2)
    for key, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_checkpoint_layout_is_one_entry_per_value_and_such_a_checkpoint_resumes():
    # The state is one packed vector inside; checkpoints keep one entry per value, with
    # the dtypes and shapes a checkpoint of separate buffers has, in both directions.
    scaling = DelayedScaling("e4m3", history_len=3)
    for values in ([1.0, 2.0], [4.0, math.inf], [300.0, 0.5]):
        scaling.cast(torch.tensor(values))
    saved = scaling.state_dict()
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in saved.items()}
    assert layout == {"scale": (torch.float32, ()), "amax": (torch.float32, ()),
                      "saturated": (torch.int64, ()), "numel": (torch.int64, ()),
                      "overflows": (torch.int64, ()), "amax_history": (torch.float32, (3,))}  # fmt: skip
    assert saved["overflows"].item() == 1 and saved["numel"].item() == 2
    assert saved["amax_history"].tolist() == [300.0, 0.0, 2.0] and saved["saturated"].item() == 1
    # A hand-written checkpoint in that layout: counts past float32's 2**24 stay exact.
    written = {"scale": torch.tensor(0.5), "amax": torch.tensor(3.0),
               "saturated": torch.tensor(2**40 + 3), "numel": torch.tensor(2**41 + 5),
               "overflows": torch.tensor(7), "amax_history": torch.tensor([3.0, 1.0, 2.0])}  # fmt: skip
    resumed = DelayedScaling("e4m3", history_len=3)
    resumed.load_state_dict(written)
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, written[key]), key
    assert float(resumed.saturated_fraction()) == pytest.approx(2**40 / 2**41)
    # The next cast continues from it as from the live state: the scale from max(history).
    resumed.cast(torch.tensor([1.0]))
    assert torch.equal(resumed.scale, 448.0 / torch.tensor(3.0)) and int(resumed.overflows) == 7
    # A damaged checkpoint is refused by key and leaves the state as it was.
    fresh = DelayedScaling("e4m3", history_len=4)
    before = fresh.state.clone()
    with pytest.raises(RuntimeError, match=r"size mismatch for amax_history.*\[3\].*\[4\]"):
        fresh.load_state_dict(written)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "amax"'):
        DelayedScaling("e4m3", history_len=3).load_state_dict(
            {k: v for k, v in written.items() if k != "amax"}
        )
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "state"'):
        DynamicScaling().load_state_dict({**DynamicScaling().state_dict(), "state": before})
    assert torch.equal(fresh.state, before)


def test_a_model_wide_low_precision_cast_leaves_the_scaling_state_float32():
    # model.half() or a level storing floating buffers in bfloat16 must not round the
    # recorded amaxes, the history or the counts: the state is not a floating buffer.
    model = nn.Sequential(nn.Linear(16, 16))
    convert_to_float8(model, "delayed", history_len=2)
    model(torch.randn(4, 16) * 1.001).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items() if "scaling" in k}
    model.bfloat16()
    assert model[0].weight.dtype == torch.bfloat16
    scaling = model[0].input_scaling
    assert scaling.state.dtype == torch.float32 and scaling.amax_history.dtype == torch.float32
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("recipe", ["dynamic", "delayed", "rowwise"])
def test_a_cast_writes_the_buffer_the_scaling_holds_now(recipe):
    # Eager casts write through views of the state buffer kept between casts; whatever
    # replaces the buffer (a copy, .to(), _apply, a functional call's swap) gets its own.
    scaling = make_scaling(recipe, "e4m3")
    scaling.cast(torch.full((2, 4), 2.0))
    twin = copy.deepcopy(scaling)
    twin.cast(torch.full((2, 4), 8.0))
    assert float(twin.amax) == 8.0 and float(scaling.amax) == 2.0
    old, old_bits = scaling._state_bits, scaling._state_bits.clone()
    scaling._apply(lambda t: t.clone())  # what .to(device) does to every buffer
    assert scaling._state_bits is not old
    scaling.cast(torch.full((2, 4), 4.0))
    assert float(scaling.amax) == 4.0 and torch.equal(old, old_bits)
    with torch.nn.utils.stateless._reparametrize_module(scaling, {"_state_bits": old}):
        scaling.cast(torch.full((2, 4), 16.0))  # a functional call's swap of the buffer
        assert float(scaling.amax) == 16.0
    assert float(scaling.amax) == 4.0 and not torch.equal(old, old_bits)
    scaling.cast(torch.full((2, 4), 0.5))
    assert float(scaling.amax) == 0.5 and int(scaling.overflows) == 0
    saved = io.BytesIO()
    torch.save(scaling, saved)  # the whole module, as torch.save(model) pickles it
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert float(loaded.amax) == 0.5
    loaded.cast(torch.full((2, 4), 32.0))
    assert float(loaded.amax) == 32.0 and float(scaling.amax) == 0.5


# -- convert_to_float8 ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)
        self.odd = nn.Linear(24, 32)
        self.normed = nn.Linear(32, 32)
        parametrize.register_parametrization(self.normed, "weight", nn.Identity())


def test_convert_swaps_eligible_layers_and_says_why_the_others_stay():
    block = Block()
    params = {name: p for name, p in block.named_parameters()}
    report = convert_to_float8(block, "dynamic")
    assert report.converted == ["up", "down"]
    assert report.skipped == {
        "attn": "not supported: float8 covers nn.Linear and Conv1D layers; nn.MultiheadAttention "
                "passes its input-projection weight to the attention function itself",
        "attn.out_proj": "nn.MultiheadAttention reads this projection's weight directly, not its forward",
        "head": "out_features=10 is not a multiple of 16",
        "odd": "in_features=24 is not a multiple of 16",
        "normed": "its weight is parametrized (the parametrization would be bypassed)",
    }  # fmt: skip
    assert isinstance(block.up, Float8Linear) and type(block.head) is nn.Linear
    assert all(p is params[name] for name, p in block.named_parameters())
    text = str(report)
    assert text.splitlines()[0] == "float8 (recipe 'dynamic'): 2 of 7 matmul layers converted"
    assert "head" in text and "out_features=10 is not a multiple of 16" in text
    again = convert_to_float8(block, "delayed")
    assert again.skipped["up"] == "already a Float8Linear" and again.recipe == "delayed"
    lonely = nn.Linear(16, 16)
    assert "use Float8Linear.from_linear" in convert_to_float8(lonely).skipped[""]


def test_module_filters_patterns_and_callables_and_shared_layers():
    def mlp():
        shared = nn.Linear(32, 32)
        return nn.ModuleDict({"enc": nn.Sequential(nn.Linear(16, 32), shared),
                              "dec": nn.Sequential(shared, nn.Linear(32, 16))})  # fmt: skip

    model = mlp()
    report = convert_to_float8(model, module_filter="enc.*")
    assert report.converted == ["enc.0", "enc.1"]
    assert report.skipped == {"dec.1": "excluded by module_filter"}
    assert model["dec"][0] is model["enc"][1] and isinstance(model["dec"][0], Float8Linear)
    model = mlp()
    report = convert_to_float8(model, module_filter=lambda name, m: m.out_features == 16)
    assert report.converted == ["dec.1"]
    report = convert_to_float8(mlp(), module_filter=["dec.1", "enc.0"])
    assert report.converted == ["enc.0", "dec.1"]


def test_an_optimizer_built_before_conversion_trains_the_float8_model():
    torch.manual_seed(0)
    before = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    after = copy.deepcopy(before)
    opt_before = torch.optim.SGD(before.parameters(), lr=0.1, momentum=0.9)
    convert_to_float8(before, "delayed")
    convert_to_float8(after, "delayed")
    opt_after = torch.optim.SGD(after.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 16)
    start = before[0].weight.detach().clone()
    for model, opt in ((before, opt_before), (after, opt_after)):
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert not torch.equal(before[0].weight, start)
    for p, q in zip(before.parameters(), after.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("bad,error,match", [
    ({"recipe": "static"}, ValueError, "recipe must be one of 'dynamic', 'delayed', 'rowwise', 'rowwise_with_gw_hp', got 'static'"),
    ({"recipe": 3}, TypeError, "recipe must be one of 'dynamic', .* or a Float8Scaling, got int 3"),
    ({"history_len": 0}, ValueError, "history_len must be an integer >= 1, got 0"),
    ({"recipe": "dynamic", "history_len": 8}, ValueError, "history_len is not an option"),
    ({"module_filter": 3}, TypeError, "module_filter must be None, an fnmatch pattern"),
    ({"output_dtype": torch.int8}, ValueError, "output_dtype must be a floating dtype"),
    ({"module_filter": lambda name, m: 1 / 0}, ZeroDivisionError, "division"),
])  # fmt: skip
def test_bad_arguments_are_refused_and_change_nothing(bad, error, match):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    before = copy.deepcopy(model.state_dict())
    kwargs = {"recipe": "delayed", **bad}
    with pytest.raises(error, match=match):
        convert_to_float8(model, **kwargs)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert model.state_dict().keys() == before.keys()
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        convert_to_float8("model")


def test_stats_name_every_float8_layer():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8(model, "delayed")
    x = torch.randn(4, 16)
    model(x).sum().backward()
    stats = read_float8_stats(model)
    assert set(stats) == {"0", "2"}
    assert stats["0"]["amax_input"] == pytest.approx(float(x.abs().max()))
    assert stats["0"]["amax_weight"] == pytest.approx(float(model[0].weight.detach().abs().max()))
    assert stats["2"]["amax_grad"] == 1.0 and stats["2"]["saturated_fraction_grad"] == 0.0
    assert stats["0"]["scale_input"] == pytest.approx(448.0 / float(x.abs().max()), rel=1e-6)
    assert isinstance(float8_stats(model)["2"]["overflows_input"], torch.Tensor)
    assert isinstance(model[0].input_scaling, Float8Scaling)


# -- torch.compile and training ---------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_training_step_equals_eager_without_graph_breaks(recipe):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8(eager, recipe, **({"history_len": 4} if recipe == "delayed" else {}))
    compiled = copy.deepcopy(eager)
    x = torch.randn(8, 16)
    report = torch._dynamo.explain(lambda t: compiled(t).square().mean())(x)
    assert report.graph_break_count == 0, [str(b.reason)[:200] for b in report.break_reasons]
    compiled.load_state_dict(eager.state_dict())  # explain ran one forward
    torch._dynamo.reset()
    step = torch.compile(lambda t: compiled(t).square().mean(), backend="aot_eager")
    for i in range(3):
        t = x * (i + 1)
        loss_eager = eager(t).square().mean()
        loss_eager.backward()
        loss_compiled = step(t)
        loss_compiled.backward()
        torch.testing.assert_close(loss_compiled, loss_eager)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[key], value, msg=key)


def synthetic_task(n, seed=0):
    """Sixteen classes from a fixed random teacher on the mean token of 8x16 inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 16, generator=gen)
    teacher = torch.randn(16, 16, generator=gen)
    return x, (x.mean(dim=(1, 2)) @ teacher).argmax(1)


def train_transformer(mode, steps, n):
    torch.manual_seed(0)
    model = TransformerClassifier(num_classes=16, seq_len=8, token_dim=16, d_model=32,
                                  nhead=2, num_layers=1, dim_feedforward=64, dropout=0.0)  # fmt: skip
    if mode != "bf16":
        report = convert_to_float8(model, mode)
        assert report.converted == ["embed", "encoder.layers.0.linear1",
                                    "encoder.layers.0.linear2", "head"]  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, labels = synthetic_task(n)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = F.cross_entropy(model(x).float(), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def check_close_to_bf16(mode, steps, n, margin):
    """Float8 reaches within ``margin`` (absolute, in nats) of the bfloat16 autocast loss,
    and both learn: the final loss is below 60% of the first."""
    bf16 = train_transformer("bf16", steps, n)
    fp8 = train_transformer(mode, steps, n)
    assert bf16[-1] < 0.6 * bf16[0] and fp8[-1] < 0.6 * fp8[0], (bf16, fp8)
    assert fp8[-1] <= bf16[-1] + margin, (bf16[-1], fp8[-1])


def test_a_small_transformer_trains_in_float8_like_bfloat16():
    check_close_to_bf16("delayed", steps=12, n=8, margin=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_small_transformer_trains_in_float8_like_bfloat16_longer(recipe):
    check_close_to_bf16(recipe, steps=60, n=32, margin=0.02)
