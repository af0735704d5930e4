"""LossScaleOptimizer: seed behaviour, delegation, validation, skipping, host syncs,
checkpoints, GradScaler parity and a float16 underflow training run."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from mixprec.compat import tf
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.tools import HostSyncCounter


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)


def snapshot(model, opt):
    return copy.deepcopy([p.detach() for p in model.parameters()]), copy.deepcopy(
        opt.inner_optimizer.state_dict()
    )


def assert_same(a, b):
    params_a, state_a = a
    params_b, state_b = b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    for key, sa in state_a["state"].items():
        for name, va in sa.items():
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(state_b["state"][key][name])), (
                name
            )


# -- the seed's examples --------------------------------------------------------------


def test_seed_minimize_then_manual_path():
    var = torch.tensor(1.0, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    loss_fn = lambda: var**2  # noqa: E731
    opt.minimize(loss_fn, var_list=var)
    assert var.item() == 0.5
    scaled_loss = opt.get_scaled_loss(loss_fn())
    (scaled_grad,) = torch.autograd.grad(scaled_loss, var)
    (grad,) = opt.get_unscaled_gradients([scaled_grad])
    opt.apply_gradients([(grad, var)])
    assert var.item() == 0.25
    assert int(opt.iterations) == 2


def test_hyperparameters_delegate_and_others_do_not():
    w = torch.zeros(2, requires_grad=True)
    inner = torch.optim.Adam([w], betas=(0.8, 0.999), eps=1e-5)
    opt = LossScaleOptimizer(inner)
    assert opt.betas == (0.8, 0.999)  # Keras beta_1 is betas[0] in PyTorch
    opt.betas = (0.7, 0.999)
    assert opt.betas[0] == 0.7 and inner.param_groups[0]["betas"] == (0.7, 0.999)
    # A non-hyperparameter attribute of the inner optimizer is not delegated.
    inner.epsilon = 1e-5
    with pytest.raises(AttributeError, match="epsilon"):
        _ = opt.epsilon
    opt.epsilon = 1e-4
    assert inner.epsilon == 1e-5
    opt.lr = 0.5
    assert inner.param_groups[0]["lr"] == 0.5


def test_attributes_follow_the_seed():
    w = torch.zeros(1, requires_grad=True)
    dyn = tf.LossScaleOptimizer(torch.optim.SGD([w], lr=1.0))
    assert dyn.dynamic and dyn.initial_scale == 2.0**15 and dyn.dynamic_growth_steps == 2000
    assert int(dyn.dynamic_counter) == 0 and dyn.loss_scale.dtype == torch.float32
    static = tf.LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), dynamic=False, initial_scale=128)
    assert not static.dynamic and static.dynamic_counter is None
    assert static.dynamic_growth_steps is None and float(static.loss_scale) == 128.0
    custom = tf.LossScaleOptimizer._with_loss_scale(torch.optim.SGD([w], lr=1.0), NoOpLossScale())
    assert float(custom.loss_scale) == 1.0 and not custom.dynamic


@pytest.mark.parametrize(
    "cls, kwargs, error, match",
    [
        (tf.LossScaleOptimizer, {"dynamic": False}, ValueError, "initial_scale"),
        (
            tf.LossScaleOptimizer,
            {"dynamic": False, "initial_scale": 8.0, "dynamic_growth_steps": 10},
            ValueError,
            "dynamic_growth_steps",
        ),
        (tf.LossScaleOptimizer, {"initial_scale": -1.0}, ValueError, "initial_scale"),
        (tf.LossScaleOptimizer, {"initial_scale": 0}, ValueError, "initial_scale"),
        (tf.LossScaleOptimizer, {"dynamic_growth_steps": 1.5}, TypeError, "dynamic_growth_steps"),
        (tf.LossScaleOptimizer, {"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps"),
        (tf.LossScaleOptimizer, {"dynamic": "yes"}, TypeError, "dynamic"),
        (LossScaleOptimizer, {"loss_scale": "static"}, ValueError, "loss_scale"),
        (LossScaleOptimizer, {"loss_scale": -1.0}, ValueError, "loss_scale"),
        (LossScaleOptimizer, {"loss_scale": True}, TypeError, "loss_scale"),
        (LossScaleOptimizer, {"clipnorm": 0.0}, ValueError, "clipnorm"),
        (LossScaleOptimizer, {"master_weights": 1}, TypeError, "master_weights"),
    ],
)
def test_constructor_validation(cls, kwargs, error, match):
    w = torch.zeros(1, requires_grad=True)
    inner = torch.optim.SGD([w], lr=1.0)
    groups_before = copy.deepcopy(inner.param_groups)
    with pytest.raises(error, match=match):
        cls(inner, **kwargs)
    assert inner.param_groups[0]["lr"] == groups_before[0]["lr"]
    assert inner.param_groups[0]["params"][0] is w


def test_inner_must_be_an_optimizer():
    with pytest.raises(TypeError, match="inner_optimizer"):
        LossScaleOptimizer("sgd")
    w = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="already"):
        LossScaleOptimizer(LossScaleOptimizer(torch.optim.SGD([w], lr=1.0)))


def test_apply_gradients_rejects_unknown_params_and_changes_nothing():
    w = torch.ones(2, requires_grad=True)
    stranger = torch.ones(3, requires_grad=True)
    opt = tf.LossScaleOptimizer(torch.optim.SGD([w], lr=1.0))
    scale_before = opt.loss_scale.clone()
    with pytest.raises(ValueError, match="does not hold"):
        opt.apply_gradients([(torch.ones(2), w), (torch.ones(3), stranger)])
    with pytest.raises(ValueError, match="shape"):
        opt.apply_gradients([(torch.ones(5), w)])
    assert torch.equal(w, torch.ones(2)) and torch.equal(opt.loss_scale, scale_before)
    assert int(opt.iterations) == 0 and w.grad is None


# -- skipping ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_skipped_step_changes_nothing(kind, fused):
    model = make_model()
    params = list(model.parameters())
    inner = (
        torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=fused)
        if kind == "sgd"
        else torch.optim.Adam(params, lr=1e-2, fused=fused)
    )
    opt = LossScaleOptimizer(inner, DynamicLossScale(initial_scale=1024.0))
    x, y = batch()
    opt.scale_loss(F.mse_loss(model(x), y)).backward()
    opt.step()
    opt.zero_grad()
    before = snapshot(model, opt)
    opt.scale_loss(F.mse_loss(model(x), y)).backward()
    params[0].grad[0, 0] = float("inf")
    opt.step()
    assert_same(before, snapshot(model, opt))
    assert bool(opt.last_step_skipped) and int(opt.skipped_steps) == 1 and int(opt.iterations) == 1
    assert float(opt.loss_scale) == 512.0 and int(opt.loss_scaler.counter) == 0
    # ...and the next finite step applies again.
    opt.zero_grad()
    opt.scale_loss(F.mse_loss(model(x), y)).backward()
    opt.step()
    assert not bool(opt.last_step_skipped) and int(opt.iterations) == 2
    assert not torch.equal(before[0][0], params[0].detach())


# -- host syncs -------------------------------------------------------------------------


def count_step_syncs(inner_factory, warm_up: bool = True) -> dict[str, int]:
    """Host syncs of one step: the wrapper's, GradScaler's, and the bare inner optimizer's.

    Non-capturable Adam reads its CPU step counter with ``.item()``: on a GPU that is
    no device sync, but the counter sees it; so what the wrapper *adds* is compared.
    With ``warm_up`` one step runs first, uncounted: a fused optimizer's first step
    (the one that creates its state) reads the overflow flag once, so that a skipped
    first step leaves no state behind.
    """
    counts = {}
    for mode in ("mixprec", "gradscaler", "inner"):
        model = make_model()
        inner = inner_factory(model.parameters())
        x, y = batch()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt = LossScaleOptimizer(inner, DynamicLossScale(initial_scale=1024.0))
        for _ in range(2 if warm_up else 1):
            loss = F.mse_loss(model(x), y)
            syncs = HostSyncCounter()
            if mode == "gradscaler":
                scaler.scale(loss).backward()
                with syncs:
                    scaler.step(inner)
                    scaler.update()
            elif mode == "mixprec":
                opt.scale_loss(loss).backward()
                with syncs:
                    opt.step()
            else:
                loss.backward()
                with syncs:
                    inner.step()
            inner.zero_grad()
        counts[mode] = syncs.count
    return counts


def test_fused_first_step_reads_the_flag_once():
    counts = count_step_syncs(lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), False)
    assert counts["mixprec"] - counts["inner"] == 1


@pytest.mark.parametrize(
    "name, factory, added",
    [
        ("adam-fused", lambda p: torch.optim.Adam(p, lr=1e-3, fused=True), 0),
        ("adamw-fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), 0),
        ("sgd-fused", lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True), 0),
        ("adam-foreach", lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True), 1),
        ("sgd", lambda p: torch.optim.SGD(p, lr=1e-3), 1),
    ],
)
def test_host_syncs_per_step(name, factory, added):
    counts = count_step_syncs(factory)  # host syncs per step of each
    assert counts["mixprec"] - counts["inner"] == added, counts
    if added == 0:
        assert counts["mixprec"] == 0, counts
    assert counts["mixprec"] <= counts["gradscaler"], counts


# -- checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_scale",
    [DynamicLossScale(initial_scale=2.0**10, growth_interval=2), StaticLossScale(64.0)],
)
def test_state_dict_resume_is_bit_exact(loss_scale):
    def run(steps, model, opt, start=0):
        for i in range(start, start + steps):
            x, y = batch(seed=100 + i)
            opt.scale_loss(F.mse_loss(model(x), y)).backward()
            if i == 3:
                next(model.parameters()).grad.fill_(float("nan"))
            opt.step()
            opt.zero_grad()

    model_a = make_model()
    opt_a = LossScaleOptimizer(
        torch.optim.Adam(model_a.parameters(), lr=1e-2), loss_scale=copy.deepcopy(loss_scale)
    )
    run(10, model_a, opt_a)

    model_b = make_model()
    opt_b = LossScaleOptimizer(
        torch.optim.Adam(model_b.parameters(), lr=1e-2), loss_scale=copy.deepcopy(loss_scale)
    )
    run(5, model_b, opt_b)
    saved = copy.deepcopy((model_b.state_dict(), opt_b.state_dict()))
    model_c = make_model(seed=99)
    opt_c = LossScaleOptimizer(
        torch.optim.Adam(model_c.parameters(), lr=1e-2),
        loss_scale=type(loss_scale).from_config(loss_scale.get_config()),
    )
    model_c.load_state_dict(saved[0])
    opt_c.load_state_dict(saved[1])
    run(5, model_c, opt_c, start=5)
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(pa, pc)
    assert torch.equal(opt_a.loss_scale, opt_c.loss_scale)
    assert int(opt_a.iterations) == int(opt_c.iterations) == 9
    assert int(opt_c.skipped_steps) == 1


def test_load_state_dict_rejects_mismatch_and_changes_nothing():
    w = torch.ones(2, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), DynamicLossScale(initial_scale=8.0))
    other = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), 2.0)
    with pytest.raises(ValueError, match="loss scale"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        opt.load_state_dict({"inner": {}, "loss_scale": {}})
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    assert float(opt.loss_scale) == 8.0


@pytest.mark.parametrize(
    "saved, loading, match",
    [
        ({"master_weights": "fp32"}, {}, "saved with master weights, this optimizer has none; "
         "build it with the checkpoint's master_weights"),
        ({}, {"use_ema": True}, "saved without moving averages of the parameters, this "
         "optimizer has them; build it with the checkpoint's use_ema"),
        ({"gradient_accumulation_steps": 2}, {}, "saved with gradient accumulation, this "
         "optimizer has none; build it with the checkpoint's gradient_accumulation_steps"),
    ],
    ids=["master", "ema", "accumulation"],
)
def test_a_checkpoint_of_another_configuration_names_the_option(saved, loading, match):
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))

    def build(**options):
        return LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), 4.0, **options)

    opt = build(**loading)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=re.escape(match)):
        opt.load_state_dict(build(**saved).state_dict())
    after = opt.state_dict()
    assert torch.equal(after["mixprec"]["loss_scale"]["state"]["scale"],
                       before["mixprec"]["loss_scale"]["state"]["scale"])  # fmt: skip
    assert after["param_groups"] == before["param_groups"]


@pytest.mark.parametrize("master_weights", [False, "fp32", "kahan"])
@pytest.mark.parametrize("overflow", [False, True])
def test_zero_grad_after_unscale_drops_the_step_as_gradscaler_update_does(overflow, master_weights):
    """A loop that looks at the clipped norm and drops the step (``zero_grad(); continue``)
    goes on to the next batch; the scale takes the dropped step's verdict as torch's
    ``scaler.update()`` after ``unscale_()`` does, and the counters do not count it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).half()
    weights = [p.detach().clone() for p in model.parameters()]
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             DynamicLossScale(initial_scale=1024.0), master_weights=master_weights)  # fmt: skip
    twin = torch.nn.Parameter(torch.ones(2))  # the same loop with torch's scaler
    twin_opt, scaler = torch.optim.SGD([twin], lr=0.1), torch.amp.GradScaler("cpu", 1024.0)
    x, y = batch()
    for drop in (True, False):
        opt.scale_loss(F.mse_loss(model(x.half()).float(), y)).backward()
        scaler.scale(twin.sum()).backward()
        if overflow:
            model[0].weight.grad[0, 0] = float("inf")
            twin.grad[0] = float("inf")
        opt.unscale_()
        scaler.unscale_(twin_opt)
        if not drop:
            opt.step()
            break
        opt.zero_grad()
        twin_opt.zero_grad()
        scaler.update()
        assert float(opt.loss_scale) == scaler.get_scale() == (512.0 if overflow else 1024.0)
        assert all(p.dtype == torch.float16 and p.grad is None for p in model.parameters())
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        assert int(opt.iterations) == int(opt.skipped_steps) == 0
    assert int(opt.iterations) == int(not overflow) and int(opt.skipped_steps) == int(overflow)


# -- PyTorch integration ----------------------------------------------------------------


def test_lr_scheduler_and_clip_grad_norm_work_on_the_wrapper():
    model = make_model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), DynamicLossScale(initial_scale=4.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch()
    opt.scale_loss(F.mse_loss(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], max_norm=1e9)
    opt.step()
    sched.step()
    assert opt.lr == 0.5 and opt.inner_optimizer.param_groups[0]["lr"] == 0.5
    assert opt.state is opt.inner_optimizer.state


def test_several_backward_passes_before_one_step():
    w = torch.zeros(3, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), DynamicLossScale(initial_scale=2.0**10))
    for k in (1.0, 2.0):
        opt.scale_loss((w * k).sum()).backward()
    opt.step()
    assert torch.equal(w.detach(), torch.full((3,), -3.0))


def test_closure_is_evaluated():
    w = torch.ones(2, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), DynamicLossScale(initial_scale=16.0))

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        opt.scale_loss(loss).backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 2.0 and torch.equal(w.detach(), torch.zeros(2))


def test_trajectory_matches_gradscaler():
    """Same model, data and overflow pattern: identical parameters and scales."""
    torch.manual_seed(0)
    models = [make_model(), make_model()]
    inners = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    opt = LossScaleOptimizer(
        inners[1],
        loss_scale=DynamicLossScale(
            initial_scale=2.0**16, growth_interval=3, min_scale=None, max_scale=None
        ),
    )
    for i in range(12):
        x, y = batch(seed=i)
        scaler.scale(F.mse_loss(models[0](x), y)).backward()
        opt.scale_loss(F.mse_loss(models[1](x), y)).backward()
        if i in (2, 7):
            for m in models:
                next(m.parameters()).grad[0, 0] = float("inf")
        scaler.step(inners[0])
        scaler.update()
        opt.step()
        for o in (inners[0], opt):
            o.zero_grad()
        assert scaler.get_scale() == float(opt.loss_scale)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


# -- float16 training -----------------------------------------------------------------


class HalfMLP(torch.nn.Module):
    """float32 parameters, float16 compute (activations and their gradients in fp16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x):
        h = torch.tanh(F.linear(x.half(), self.fc1.weight.half(), self.fc1.bias.half()))
        return F.linear(h, self.fc2.weight.half(), self.fc2.bias.half()).float()


def regression_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    return x, y


# The loss is measured in tiny units (x 2**-20): harmless for Adam in float32 (it
# normalises the gradient), fatal for float16 gradients, which flush to zero.
UNITS = 2.0**-20


def train(model, opt_factory, steps=150):
    x, y = regression_data()
    opt = opt_factory(model.parameters())
    zero_fraction = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y) * UNITS
        if isinstance(opt, LossScaleOptimizer):
            opt.scale_loss(loss).backward()
        else:
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        zero_fraction.append(float((grads == 0).float().mean()))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return float(F.mse_loss(model(x).float(), y)), zero_fraction


def test_float16_underflow_is_rescued_by_dynamic_loss_scaling():
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    fp32_model = HalfMLP().float()
    fp32_model.forward = lambda x: torch.nn.Sequential(
        fp32_model.fc1, torch.nn.Tanh(), fp32_model.fc2
    )(x)
    fp32_loss, _ = train(fp32_model, adam)
    fp16_loss, fp16_zeros = train(HalfMLP(), adam)
    scaled_loss, scaled_zeros = train(
        HalfMLP(),
        lambda p: LossScaleOptimizer(torch.optim.Adam(p, lr=1e-2), DynamicLossScale(growth_interval=50)),
    )
    initial_loss, _ = train(HalfMLP(), adam, steps=0)
    seen = {"float32": fp32_loss, "fp16 unscaled": fp16_loss, "fp16 scaled": scaled_loss,
            "start": initial_loss, "zero grads unscaled": fp16_zeros[0],
            "zero grads scaled": scaled_zeros[-1]}  # fmt: skip
    assert fp16_zeros[0] > 0.9, seen  # measured: the unscaled fp16 gradients underflow
    assert fp16_loss > 0.9 * initial_loss, seen  # ...so training does not move
    assert scaled_zeros[-1] < 0.1, seen
    assert scaled_loss < 1.2 * fp32_loss + 1e-3, seen  # reaches the float32 loss
    assert fp32_loss < 0.2 * initial_loss, seen


def test_apply_anyway_mode_needs_no_host_sync():
    """skip_nonfinite=False (MindSpore's drop_overflow_update=False) never reads the flag."""
    model = make_model()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_scale=StaticLossScale(8.0),
        skip_nonfinite=False,
    )
    x, y = batch()
    opt.scale_loss(F.mse_loss(model(x), y)).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    with HostSyncCounter() as syncs:
        opt.step()
    assert syncs.count == 0
    assert not torch.isfinite(next(model.parameters())).all()  # applied anyway
    assert int(opt.skipped_steps) == 0 and int(opt.iterations) == 1
