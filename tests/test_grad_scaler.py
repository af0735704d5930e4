"""mixprec.GradScaler side by side with torch.amp.GradScaler: the API's behaviours, the
recipes of PyTorch's AMP examples (bit-exact parameters and scale sequences with inf/NaN
injected), checkpoints, mixprec's additions, misuse and host syncs."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.loss_scale import DynamicLossScale, ScaleCollapseError
from mixprec.tools import HostSyncCounter

pytestmark = pytest.mark.usefixtures("one_thread")

SCALERS = {"torch": torch.amp.GradScaler, "mixprec": mixprec.GradScaler}
OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-momentum-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
}
FUSED = ("sgd-momentum-fused", "adamw-fused")
STEPS = 10
INIT = 2.0**10


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    return torch.nn.Sequential(*layers).to(dtype)


def make_batches(n: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def overflow_schedule(opt_name: str, seed: int = 0) -> dict[int, float]:
    """Three steps picked by a seeded generator get inf, NaN, -inf; a non-fused optimizer
    also overflows on its first step (torch's fused SGD mishandles a skipped first step)."""
    g = torch.Generator().manual_seed(seed)
    steps = sorted((torch.randperm(STEPS - 1, generator=g)[:3] + 1).tolist())
    schedule = dict(zip(steps, [math.inf, math.nan, -math.inf]))
    if opt_name not in FUSED:
        schedule[0] = math.inf
    return schedule


class Trial:
    """One run: model(s), one optimizer each, a scaler; the history of scales and params."""

    def __init__(self, kind, opt_name, n_models=1, model_seed=0, **scaler_kwargs):
        self.models = [make_model(model_seed + i) for i in range(n_models)]
        self.opts = [OPTIMIZERS[opt_name](m.parameters()) for m in self.models]
        kwargs = {"init_scale": INIT, "growth_interval": 2, **scaler_kwargs}
        self.scaler = SCALERS[kind]("cpu", **kwargs)
        self.scales: list[float] = []
        self.history: list[list[list[torch.Tensor]]] = []
        self.poisoned: dict[int, int] = {}

    @property
    def model(self):
        return self.models[0]

    @property
    def opt(self):
        return self.opts[0]

    def params(self) -> list[list[torch.Tensor]]:
        return [[p.detach().clone() for p in m.parameters()] for m in self.models]

    def inject(self, step: int, value: float | None, index: int = 0) -> None:
        if value is not None:
            next(self.models[index].parameters()).grad.view(-1)[0] = value
            self.poisoned[step] = index


# -- the recipes of PyTorch's AMP examples, one optimizer step each -------------------------


def typical(t: Trial, step: int, batches: list, bad: float | None) -> None:
    ((x, y),) = batches
    t.opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(t.model(x), y)
    t.scaler.scale(loss).backward()
    t.inject(step, bad)
    t.scaler.step(t.opt)
    t.scaler.update()


def clipping(t: Trial, step: int, batches: list, bad: float | None) -> None:
    ((x, y),) = batches
    t.opt.zero_grad()
    t.scaler.scale(F.mse_loss(t.model(x), y)).backward()
    t.inject(step, bad)
    t.scaler.unscale_(t.opt)  # clip the true gradients
    torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm=0.3)
    t.scaler.step(t.opt)
    t.scaler.update()


def accumulation(t: Trial, step: int, batches: list, bad: float | None) -> None:
    for x, y in batches:  # scale every micro-batch; step and update once
        t.scaler.scale(F.mse_loss(t.model(x), y) / len(batches)).backward()
    t.inject(step, bad)
    t.scaler.step(t.opt)
    t.scaler.update()
    t.opt.zero_grad()


def penalty(t: Trial, step: int, batches: list, bad: float | None) -> None:
    ((x, y),) = batches
    t.opt.zero_grad()
    loss = F.mse_loss(t.model(x), y)
    params = list(t.model.parameters())
    scaled = torch.autograd.grad(t.scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / t.scaler.get_scale()  # unscaled by hand, as the example does
    grad_norm = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled]).sum().sqrt()
    t.scaler.scale(loss + grad_norm).backward()
    t.inject(step, bad)
    t.scaler.step(t.opt)
    t.scaler.update()


def two_models(t: Trial, step: int, batches: list, bad: float | None) -> None:
    ((x, y),) = batches
    for opt in t.opts:
        opt.zero_grad()
    out0, out1 = t.models[0](x), t.models[1](x)
    loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
    loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
    t.scaler.scale(loss0).backward(retain_graph=True)
    t.scaler.scale(loss1).backward()
    t.inject(step, bad, index=step % 2)  # one optimizer skips, the other steps
    t.scaler.unscale_(t.opts[0])
    t.scaler.step(t.opts[0])
    t.scaler.step(t.opts[1])
    t.scaler.update()


# name: (recipe, micro-batches per step, models)
RECIPES = {
    "typical": (typical, 1, 1),
    "clipping": (clipping, 1, 1),
    "accumulation": (accumulation, 3, 1),
    "penalty": (penalty, 1, 1),
    "two-models": (two_models, 1, 2),
}


def train(t: Trial, recipe: str, schedule: dict[int, float], steps=range(STEPS)) -> Trial:
    fn, micro, _ = RECIPES[recipe]
    data = make_batches((max(steps, default=0) + 1) * micro)  # the same prefix for any length
    for step in steps:
        fn(t, step, data[step * micro : (step + 1) * micro], schedule.get(step))
        t.scales.append(t.scaler.get_scale())
        t.history.append(t.params())
    return t


def assert_same_values(a, b, where=""):
    """Nested dicts/lists of tensors and numbers, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_same_values(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_values(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(a: Trial, b: Trial) -> None:
    assert a.scales == b.scales
    for step, (pa, pb) in enumerate(zip(a.history, b.history, strict=True)):
        assert_same_values(pa, pb, f"parameters after step {step}")
    for oa, ob in zip(a.opts, b.opts):
        assert_same_values(oa.state_dict(), ob.state_dict(), "optimizer state")


def scaler_snapshot(scaler) -> dict:
    return copy.deepcopy(scaler.state_dict())


# -- torch's GradScaler behaviours ------------------------------------------------------------


def flatten(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for item in outputs for t in flatten(item)]


def test_scale_multiplies_tensors_and_nested_iterables_as_torch_does():
    t0 = torch.full((2,), 4.0)
    nested = (t0, (t0, t0), [t0, (t0, t0.half())])
    got = {kind: cls("cpu", init_scale=2.0).scale(nested) for kind, cls in SCALERS.items()}
    for out in got.values():
        assert type(out) is tuple and type(out[1]) is tuple and type(out[2]) is list
        assert type(out[2][1]) is tuple and out[2][1][1].dtype == torch.float16
    assert_same_values(got["torch"], got["mixprec"])
    assert all(torch.equal(t.float(), torch.full((2,), 8.0)) for t in flatten(got["mixprec"]))
    lazily = {kind: list(cls("cpu", init_scale=2.0).scale(t for t in [t0, t0]))
              for kind, cls in SCALERS.items()}  # fmt: skip
    assert_same_values(lazily["torch"], lazily["mixprec"])
    assert torch.equal(lazily["mixprec"][1], torch.full((2,), 8.0))
    for cls in SCALERS.values():
        with pytest.raises(ValueError, match="Tensor or an iterable"):
            cls("cpu").scale(3.0)
        with pytest.raises(ValueError, match="Tensor or an iterable"):
            cls("cpu").scale([t0, 3.0])


def one_scaled_backward(t: Trial, seed: int = 3) -> None:
    x, y = make_batches(1, seed=seed)[0]
    for opt in t.opts:
        opt.zero_grad()
    t.scaler.scale(F.mse_loss(t.model(x), y)).backward()


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw-fused"])
@pytest.mark.parametrize("kind", SCALERS)
def test_unscale_and_step_order_is_enforced_as_torch_does(kind, opt_name):
    t = Trial(kind, opt_name)
    one_scaled_backward(t)
    t.scaler.unscale_(t.opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        t.scaler.unscale_(t.opt)
    t.scaler.step(t.opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step"):
        t.scaler.unscale_(t.opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        t.scaler.step(t.opt)
    t.scaler.update()
    one_scaled_backward(t)  # a new iteration: step without unscale_, twice
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        t.scaler.step(t.opt, closure=lambda: None)
    t.scaler.step(t.opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        t.scaler.step(t.opt)
    t.scaler.update()
    assert t.scaler.get_scale() == INIT * 2  # two finite steps, growth_interval=2


@pytest.mark.parametrize("form", ["float", "tensor"])
def test_update_with_a_new_scale_sets_it_as_torch_does(form):
    runs = {}
    for kind in SCALERS:
        t = Trial(kind, "sgd-momentum", growth_interval=1)
        one_scaled_backward(t)
        t.scaler.step(t.opt)
        new_scale = 8.0 if form == "float" else torch.tensor(8.0)
        t.scaler.update(new_scale)
        if form == "tensor":
            new_scale.fill_(3.0)  # later changes to the tensor do not reach the scale
        scales = [t.scaler.get_scale()]
        one_scaled_backward(t, seed=4)
        t.scaler.step(t.opt)
        t.scaler.update()
        scales.append(t.scaler.get_scale())
        runs[kind] = (scales, t.scaler.state_dict()["_growth_tracker"], t.params())
    assert runs["mixprec"][0] == runs["torch"][0] == [8.0, 16.0]
    assert_same_values(runs["torch"][1:], runs["mixprec"][1:])


def test_a_bad_new_scale_is_rejected_and_changes_nothing():
    bad_tensors = [torch.tensor([2.0, 3.0]), torch.tensor(2.0, requires_grad=True)]
    scalers = {}
    for kind in SCALERS:
        t = Trial(kind, "sgd-momentum")
        one_scaled_backward(t)
        t.scaler.step(t.opt)
        scalers[kind] = t.scaler
    for bad in bad_tensors:
        with pytest.raises(AssertionError):  # torch's wording for these
            scalers["torch"].update(bad)
    mine = scalers["mixprec"]
    for bad in [*bad_tensors, 0.0, -4.0, math.nan, math.inf]:
        with pytest.raises(ValueError, match="new_scale"):
            mine.update(bad)
    for value in (math.nan, 0.0, -1.0, math.inf, -math.inf):  # the tensor forms, as the floats
        with pytest.raises(ValueError, match=rf"new_scale must be .*finite.*, got {value}"):
            mine.update(torch.tensor(value))
    with pytest.raises(TypeError, match="new_scale"):
        mine.update("8.0")
    assert mine.get_scale() == INIT
    mine.update()  # the iteration's flags are still there
    scalers["torch"].update()
    assert (
        mine.state_dict()["_growth_tracker"]
        == scalers["torch"].state_dict()["_growth_tracker"]
        == 1
    )


def test_hyperparameter_accessors_match_torch_and_steer_the_update():
    runs = {}
    for kind in SCALERS:
        t = Trial(kind, "sgd-momentum", growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
        got = [t.scaler.get_growth_factor(), t.scaler.get_backoff_factor(),
               t.scaler.get_growth_interval()]  # fmt: skip
        assert got == [2.0, 0.5, 3]
        train(t, "clipping", {2: math.inf}, range(3))  # growth tracker back at 0
        t.scaler.set_growth_factor(4.0)
        t.scaler.set_backoff_factor(0.25)
        t.scaler.set_growth_interval(1)
        got = [t.scaler.get_growth_factor(), t.scaler.get_backoff_factor(),
               t.scaler.get_growth_interval()]  # fmt: skip
        assert got == [4.0, 0.25, 1]
        runs[kind] = train(t, "clipping", {5: math.nan}, range(3, 8))
    assert_same_run(runs["torch"], runs["mixprec"])
    assert runs["mixprec"].scales == [INIT, INIT, INIT / 2, INIT * 2, INIT * 8, INIT * 2,
                                      INIT * 8, INIT * 32]  # fmt: skip


BAD_SETTINGS = [
    ("set_growth_factor", 1.0),
    ("set_growth_factor", math.nan),
    ("set_backoff_factor", 1.0),
    ("set_backoff_factor", 0.0),
    ("set_growth_interval", 0),
    ("set_init_scale", 0.0),
    ("set_init_scale", math.inf),
]


@pytest.mark.parametrize("setter, bad", BAD_SETTINGS)
def test_a_setter_rejects_what_the_constructor_rejects_and_changes_nothing(setter, bad):
    """A value the constructor refuses is refused by the setter too (else the checkpoint it
    writes cannot be loaded)."""
    scaler = mixprec.GradScaler("cpu", init_scale=16.0, growth_interval=5)
    with pytest.raises(ValueError, match="new_"):
        getattr(scaler, setter)(bad)
    got = [scaler.get_growth_factor(), scaler.get_backoff_factor(),
           scaler.get_growth_interval(), scaler.get_init_scale()]  # fmt: skip
    assert got == [2.0, 0.5, 5, 16.0]
    mixprec.GradScaler("cpu").load_state_dict(scaler.state_dict())


def test_setters_and_constructor_validate():
    scaler = mixprec.GradScaler("cpu", init_scale=16.0)
    with pytest.raises(TypeError, match="new_interval"):
        scaler.set_growth_interval(2.5)
    scaler.set_init_scale(32.0)
    assert scaler.get_init_scale() == 32.0 and scaler.get_scale() == 16.0
    assert scaler.state_dict()["mixprec"]["config"]["initial_scale"] == 32.0
    for kwargs in [{"growth_factor": 1.0}, {"backoff_factor": 1.5}, {"backoff_factor": 1.0},
                   {"init_scale": 0.0}, {"growth_interval": 0}]:  # fmt: skip
        with pytest.raises(ValueError):
            mixprec.GradScaler("cpu", **kwargs)


def test_set_init_scale_outside_the_bounds_is_rejected():
    """A bad initial scale is refused when set, not later by the checkpoint it breaks."""
    scaler = mixprec.GradScaler("cpu", init_scale=16.0, min_scale=8.0)
    with pytest.raises(ValueError, match="init"):
        scaler.set_init_scale(4.0)
    assert scaler.get_init_scale() == 16.0
    mixprec.GradScaler("cpu", min_scale=8.0).load_state_dict(scaler.state_dict())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_is_enabled_and_a_cuda_scaler_without_cuda_disables_itself_as_torch_does():
    for cls in SCALERS.values():
        assert cls("cpu").is_enabled() and not cls("cpu", enabled=False).is_enabled()
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = cls("cuda")
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0


@pytest.mark.parametrize("kind", SCALERS)
def test_a_disabled_scaler_passes_everything_through(kind):
    model, reference = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = SCALERS[kind]("cpu", enabled=False)
    x, y = make_batches(1)[0]
    loss = F.mse_loss(model(x), y)
    outputs = [loss, (loss,)]
    assert scaler.scale(loss) is loss and scaler.scale(outputs) is outputs
    loss.backward()
    F.mse_loss(reference(x), y).backward()
    scaler.unscale_(opt)
    assert_same_values(
        [p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]
    )
    assert scaler.step(opt) is None
    scaler.update()
    ref_opt.step()
    assert_same_values(list(model.parameters()), list(reference.parameters()))

    def closure():
        opt.zero_grad()
        step_loss = F.mse_loss(model(x), y)
        step_loss.backward()
        return step_loss

    assert torch.is_tensor(scaler.step(opt, closure=closure))  # forwarded to optimizer.step
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


#: A state dict as ``torch.amp.GradScaler.state_dict()`` writes one.
TORCH_STATE = {"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
               "_growth_tracker": 1}  # fmt: skip


def test_a_disabled_scaler_loads_what_a_disabled_scaler_saved_as_torch_does():
    """``GradScaler(enabled=use_amp)`` resuming its own checkpoint with use_amp=False."""
    torch.amp.GradScaler("cpu", enabled=False).load_state_dict({})  # torch: a no-op
    scaler = mixprec.GradScaler("cpu", enabled=False)
    scaler.load_state_dict(scaler.state_dict())
    assert scaler.get_scale() == 1.0


def test_an_enabled_scaler_refuses_an_empty_state_dict_as_torch_does():
    for cls in SCALERS.values():
        # Resume code matches this phrase to skip a disabled scaler's checkpoint.
        with pytest.raises(RuntimeError, match="source state dict is empty"):
            cls("cpu").load_state_dict({})


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ({"scale": 2.0}, ValueError, "lacks 'growth_factor', 'backoff_factor', 'growth_interval'"),
        ([("scale", 2.0)], TypeError, "got list"),
        ({**TORCH_STATE, "scale": -2.0}, ValueError, "positive"),
    ],
    ids=["partial", "not-a-dict", "negative-scale"],
)
def test_a_state_dict_that_no_scaler_saved_is_refused_and_changes_nothing(bad, error, match):
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(bad)
    after = scaler.state_dict()
    assert after.pop("mixprec") is not None and before.pop("mixprec") is not None
    assert after == before and scaler.get_scale() == 8.0
    scaler.load_state_dict(TORCH_STATE)  # a whole torch.amp.GradScaler state loads
    assert scaler.get_scale() == 4.0 and scaler.get_growth_interval() == 3


# -- the AMP examples, bit for bit ------------------------------------------------------------


def count_changes(scales: list[float]) -> tuple[int, int]:
    """(back-offs, growths) in a scale sequence that started at INIT."""
    pairs = list(zip([INIT, *scales], scales))
    return sum(b < a for a, b in pairs), sum(b > a for a, b in pairs)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_torch_bit_for_bit(recipe, opt_name):
    schedule = overflow_schedule(opt_name)
    runs = {kind: train(Trial(kind, opt_name, n_models=RECIPES[recipe][2]), recipe, schedule)
            for kind in SCALERS}  # fmt: skip
    assert_same_run(runs["torch"], runs["mixprec"])
    mine = runs["mixprec"]
    backoffs, growths = count_changes(mine.scales)
    assert backoffs == len(schedule) and growths > 0
    for step, index in mine.poisoned.items():  # the poisoned optimizer skipped its step
        before = mine.history[step - 1] if step else Trial("mixprec", opt_name, 2).params()
        assert_same_values(mine.history[step][index], before[index], f"skipped step {step}")


@pytest.mark.parametrize("opt_name", FUSED)
def test_a_skipped_first_fused_step_leaves_no_state_and_training_continues(opt_name):
    """torch's fused kernels create state on a skipped first step (SGD's momentum buffer
    left as the raw gradient); mixprec skips that step on the host instead."""
    mine = Trial("mixprec", opt_name)
    initial = mine.params()
    schedule = {0: math.inf, 6: math.nan}
    train(mine, "clipping", schedule, range(1))
    assert len(mine.opt.state) == 0 and mine.opt.state_dict()["state"] == {}
    assert_same_values(mine.params(), initial, "parameters after the skipped first step")
    assert mine.scales == [INIT / 2]
    train(mine, "clipping", schedule, range(1, STEPS))
    # From there it is a run that never had that step, starting at the backed-off scale.
    reference = train(
        Trial("torch", opt_name, init_scale=INIT / 2), "clipping", schedule, range(1, STEPS)
    )
    mine.scales, mine.history = mine.scales[1:], mine.history[1:]
    assert_same_run(reference, mine)


# -- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw-fused"])
def test_state_dict_holds_torchs_entries_with_torchs_values(opt_name):
    runs = {kind: Trial(kind, opt_name, growth_interval=3) for kind in SCALERS}
    fresh = {kind: t.scaler.state_dict() for kind, t in runs.items()}
    for t in runs.values():
        train(t, "clipping", {3: math.inf}, range(6))
    trained = {kind: t.scaler.state_dict() for kind, t in runs.items()}
    for sd in (fresh, trained):
        keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
        assert set(sd["torch"]) == keys
        mine = {k: sd["mixprec"][k] for k in keys}
        assert mine == sd["torch"]
        assert {k: type(v) for k, v in mine.items()} == {k: type(v) for k, v in sd["torch"].items()}
    # grown at step 2, backed off at 3, two finite steps since
    assert (trained["torch"]["scale"], trained["torch"]["_growth_tracker"]) == (INIT, 2)


def checkpoint_round_trip(t: Trial) -> dict:
    state = {"models": [m.state_dict() for m in t.models],
             "opts": [o.state_dict() for o in t.opts], "scaler": t.scaler.state_dict()}  # fmt: skip
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("saver, loader", [("mixprec", "mixprec"), ("torch", "mixprec"),
                                           ("mixprec", "torch")])  # fmt: skip
def test_resume_mid_run_is_bit_exact(opt_name, saver, loader):
    schedule = {2: math.inf, 7: math.nan}
    whole = train(Trial(saver, opt_name, growth_interval=3), "clipping", schedule)
    first = train(Trial(saver, opt_name, growth_interval=3), "clipping", schedule, range(5))
    state = checkpoint_round_trip(first)
    assert state["scaler"]["_growth_tracker"] == 2  # mid-way to a growth
    second = Trial(loader, opt_name, model_seed=7, init_scale=3.0, growth_interval=7)
    for model, opt, m_state, o_state in zip(second.models, second.opts, state["models"],
                                            state["opts"]):  # fmt: skip
        model.load_state_dict(m_state)
        opt.load_state_dict(o_state)
    second.scaler.load_state_dict(state["scaler"])
    train(second, "clipping", schedule, range(5, STEPS))
    whole.scales, whole.history = whole.scales[5:], whole.history[5:]
    assert_same_run(whole, second)
    assert second.scales[0] == 2 * first.scales[-1]  # the restored tracker made it grow


def test_resume_restores_mixprecs_own_settings_and_hysteresis_state():
    schedule = {4: math.inf, 5: math.nan}
    whole = train(Trial("mixprec", "adam-foreach", hysteresis=2, max_scale=2.0**12), "clipping",
                  schedule)  # fmt: skip
    assert whole.scales[3:6] == [2.0**12, 2.0**12, 2.0**11]  # capped; backs off on the 2nd
    first = Trial("mixprec", "adam-foreach", hysteresis=2, max_scale=2.0**12)
    train(first, "clipping", schedule, range(5))
    state = checkpoint_round_trip(first)
    second = Trial("mixprec", "adam-foreach", model_seed=7)  # default settings until loaded
    second.model.load_state_dict(state["models"][0])
    second.opt.load_state_dict(state["opts"][0])
    second.scaler.load_state_dict(state["scaler"])
    train(second, "clipping", schedule, range(5, STEPS))
    whole.scales, whole.history = whole.scales[5:], whole.history[5:]
    assert_same_run(whole, second)


# -- mixprec's additions ----------------------------------------------------------------------


def documented_rule(flags, init, interval, min_scale=None, max_scale=None, hysteresis=1):
    """DynamicLossScale's docstring pseudo-code, in plain Python."""
    scale, counter, streak, out = init, 0, 0, []
    for found in flags:
        if found:
            counter, streak = 0, streak + 1
            if streak >= hysteresis:
                scale = max(scale * 0.5, min_scale or 0.0)
        else:
            streak, counter = 0, counter + 1
            if counter == interval:
                counter = 0
                scale = min(scale * 2.0, max_scale or math.inf)
        out.append(scale)
    return out


SETTINGS = {
    "max": {"max_scale": 2.0**11},
    "min": {"min_scale": 2.0**10},
    "hysteresis": {"hysteresis": 2},
    "all": {"min_scale": 2.0**9, "max_scale": 2.0**11, "hysteresis": 2},
}


@pytest.mark.parametrize("how", ["kwargs", "loss_scale"])
@pytest.mark.parametrize("name", SETTINGS)
def test_bounds_and_hysteresis_follow_the_dynamic_loss_scale(name, how):
    settings = SETTINGS[name]
    schedule = {4: math.inf, 5: math.nan, 6: -math.inf, 9: math.inf}
    steps = 12
    driven = DynamicLossScale(initial_scale=INIT, growth_interval=2, collapse_after=None,
                              **{"min_scale": None, "max_scale": None, **settings})  # fmt: skip
    expected = []
    for step in range(steps):  # the loss scale driven by hand with the same overflow flags
        driven.update(torch.tensor(float(step in schedule)))
        expected.append(float(driven.scale))
    flags = [step in schedule for step in range(steps)]
    assert expected == documented_rule(flags, INIT, 2, **settings)
    if how == "kwargs":
        mine = Trial("mixprec", "sgd-momentum", **settings)
    else:
        mine = Trial("mixprec", "sgd-momentum")
        mine.scaler = mixprec.GradScaler("cpu", loss_scale=DynamicLossScale(
            initial_scale=INIT, growth_interval=2, collapse_after=None,
            **{"min_scale": None, "max_scale": None, **settings}))  # fmt: skip
    train(mine, "typical", schedule, range(steps))
    theirs = train(Trial("torch", "sgd-momentum"), "typical", schedule, range(steps))
    assert mine.scales == expected and mine.scales != theirs.scales
    assert_same_values(mine.scaler.state_dict()["mixprec"]["state"], driven.state_dict())
    # Steps are skipped exactly where torch skips them; power-of-two scales unscale exactly.
    assert_same_values(mine.history, theirs.history)


def overflowing_iteration(t: Trial, step: int) -> None:
    one_scaled_backward(t, seed=step)
    t.inject(step, math.inf)
    t.scaler.step(t.opt)


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam-foreach", "adamw-fused"])
def test_scale_collapse_raises_after_five_overflows_at_the_floor(opt_name):
    t = Trial("mixprec", opt_name, init_scale=16.0, min_scale=1.0, collapse_after=5)
    raised_at = None
    for step in range(1, 30):
        overflowing_iteration(t, step)
        try:
            t.scaler.update()
        except ScaleCollapseError:
            raised_at = step
            break
        t.scales.append(t.scaler.get_scale())
    # 16 -> 8 -> 4 -> 2 -> 1 takes four steps; then five overflowing steps at the floor.
    assert raised_at == 4 + 5
    assert t.scales == [8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_collapse_after_none_never_raises():
    t = Trial("mixprec", "sgd-momentum", init_scale=16.0, min_scale=1.0, collapse_after=None)
    before = t.params()
    for step in range(40):
        overflowing_iteration(t, step)
        t.scaler.update()
    assert t.scaler.get_scale() == 1.0
    assert_same_values(t.params(), before)


def test_after_a_scale_collapse_error_the_scaler_takes_the_next_iteration():
    """A loop that catches the error (to lower the learning rate, or to load a checkpoint)
    goes on: the failed update() still ends the iteration."""
    t = Trial("mixprec", "sgd-momentum", init_scale=2.0, min_scale=1.0, collapse_after=1)
    with pytest.raises(ScaleCollapseError):
        for step in range(10):
            overflowing_iteration(t, step)
            t.scaler.update()
    before = t.params()
    one_scaled_backward(t)
    t.scaler.step(t.opt)
    t.scaler.update()
    assert t.scaler.get_scale() == 1.0
    assert not torch.equal(t.params()[0][0], before[0][0])


@pytest.mark.parametrize("warm_up", [0, 2])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_step_after_an_unscaled_backward_raises_and_changes_nothing(opt_name, warm_up):
    mine = train(Trial("mixprec", opt_name), "clipping", {}, range(warm_up))
    x, y = make_batches(1, seed=9)[0]
    mine.opt.zero_grad()
    F.mse_loss(mine.model(x), y).backward()  # not through scaler.scale
    before = (mine.params(), copy.deepcopy(mine.opt.state_dict()), scaler_snapshot(mine.scaler))
    for call in (mine.scaler.step, mine.scaler.unscale_):
        with pytest.raises(RuntimeError, match=r"scaler\.scale\(loss\)"):
            call(mine.opt)
    after = (mine.params(), mine.opt.state_dict(), scaler_snapshot(mine.scaler))
    assert_same_values(before, after)
    # The loop goes on as if that iteration never happened.
    train(mine, "clipping", {warm_up + 1: math.nan}, range(warm_up, warm_up + 3))
    theirs = train(Trial("torch", opt_name), "clipping", {warm_up + 1: math.nan},
                   range(warm_up + 3))  # fmt: skip
    assert_same_run(theirs, mine)


def test_a_loss_scale_optimizer_is_refused_and_nothing_changes():
    model = make_model()
    opt = mixprec.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = mixprec.GradScaler("cpu", init_scale=INIT)
    x, y = make_batches(1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    before = ([p.detach().clone() for p in model.parameters()],
              [p.grad.clone() for p in model.parameters()], scaler_snapshot(scaler))  # fmt: skip
    for call in (scaler.step, scaler.unscale_):
        with pytest.raises(TypeError, match="LossScaleOptimizer"):
            call(opt)
    after = ([p.detach() for p in model.parameters()], [p.grad for p in model.parameters()],
             scaler_snapshot(scaler))  # fmt: skip
    assert_same_values(before, after)


def test_float16_gradients_are_unscaled_where_torch_refuses_them():
    x, y = make_batches(1)[0]
    models = {kind: make_model(dtype=torch.float16) for kind in ("torch", "mixprec", "plain")}
    opts = {kind: torch.optim.SGD(m.parameters(), lr=0.1) for kind, m in models.items()}
    scalers = {kind: cls("cpu", init_scale=16.0) for kind, cls in SCALERS.items()}

    def loss_of(kind):
        return F.mse_loss(models[kind](x.half()).float(), y)

    for kind, scaler in scalers.items():
        opts[kind].zero_grad()
        scaler.scale(loss_of(kind)).backward()
    for call in (scalers["torch"].unscale_, scalers["torch"].step):
        with pytest.raises(ValueError, match="FP16"):
            call(opts["torch"])
    loss_of("plain").backward()
    scalers["mixprec"].unscale_(opts["mixprec"])
    plain_grads = [p.grad for p in models["plain"].parameters()]
    assert plain_grads[0].dtype == torch.float16
    assert_same_values([p.grad for p in models["mixprec"].parameters()], plain_grads)
    scalers["mixprec"].step(opts["mixprec"])
    scalers["mixprec"].update()
    opts["plain"].step()
    assert_same_values(list(models["mixprec"].parameters()), list(models["plain"].parameters()))
    opts["mixprec"].zero_grad()  # an overflowing float16 step is skipped and backs off
    scalers["mixprec"].scale(loss_of("mixprec")).backward()
    next(models["mixprec"].parameters()).grad.view(-1)[0] = math.inf
    scalers["mixprec"].step(opts["mixprec"])
    scalers["mixprec"].update()
    assert scalers["mixprec"].get_scale() == 8.0
    assert_same_values(list(models["mixprec"].parameters()), list(models["plain"].parameters()))


# -- host syncs -------------------------------------------------------------------------------


def count_syncs(kind: str, opt_name: str, overflow: bool, **scaler_kwargs) -> tuple[int, int]:
    """Host syncs of ``scaler.scale`` and of ``step(); update()``, after one warm-up step."""
    t = Trial(kind, opt_name, **scaler_kwargs)
    for step in range(2):
        for_scale, for_step = HostSyncCounter(), HostSyncCounter()
        x, y = make_batches(2)[step]
        t.opt.zero_grad()
        loss = F.mse_loss(t.model(x), y)
        with for_scale:
            scaled = t.scaler.scale(loss)
        scaled.backward()
        t.inject(step, math.inf if overflow and step == 1 else None)
        with for_step:
            t.scaler.step(t.opt)
            t.scaler.update()
    return for_scale.count, for_step.count


@pytest.mark.parametrize(
    "opt_name, overflow, extra, expected",
    [
        ("adamw-fused", False, {}, 0),
        ("sgd-momentum-fused", False, {}, 0),
        ("sgd-momentum", False, {}, 1),
        ("adam-foreach", False, {}, None),  # Adam reads its CPU step counters itself
        ("adamw-fused", True, {}, 0),
        ("sgd-momentum", True, {"collapse_after": None}, 1),
    ],
)
def test_step_and_update_sync_no_more_than_torch(opt_name, overflow, extra, expected):
    theirs = count_syncs("torch", opt_name, overflow)
    mine = count_syncs("mixprec", opt_name, overflow, **extra)
    # (scale, step + update) host syncs of each
    assert mine[0] == 0, (theirs, mine)
    assert mine[1] <= theirs[1], (theirs, mine)
    if expected is not None:
        assert mine[1] == theirs[1] == expected, (theirs, mine)


def test_a_skipped_non_fused_step_reads_the_flag_once_as_torch_does():
    """The collapse check counts skips on the host and reads the collapse flag only
    after ``collapse_after`` skips in a row: a skipped step costs what torch's does."""
    theirs = count_syncs("torch", "sgd-momentum", True)
    mine = count_syncs("mixprec", "sgd-momentum", True)
    assert mine[1] == theirs[1] == 1
