"""LossScaleOptimizer as any training code drives it: torch's unscale_ recipe, misuse
caught, skipped steps that leave every optimizer's state as it was (first step
included), tensor counters under torch.compile, torch-shaped checkpoints (hooks,
weights_only, distributed-checkpoint helpers) and scale collapse."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from mixprec.compat import tf
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, ScaleCollapseError
from mixprec.optim import LossScaleOptimizer

TORCH_RULE = dict(initial_scale=1024.0, growth_interval=2, min_scale=None, max_scale=None)
INFS = {2, 5, 6}


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(9)]
    return model, batches


def poison(model, step: int) -> None:
    if step in INFS:
        next(model.parameters()).grad[0, 0] = float("nan") if step == 5 else float("inf")


INNER = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-momentum-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


def snapshot(model, opt) -> list[torch.Tensor]:
    state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in model.parameters()] + state


def equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- torch's unscale_ recipe ---------------------------------------------------------------


@pytest.mark.parametrize("inner", ["sgd-momentum", "adam-foreach", "adamw-fused"])
def test_unscale_recipe_matches_gradscaler_bit_for_bit(inner):
    """scale_loss, unscale_, clip_grad_norm_, step == GradScaler's documented recipe."""
    results = []
    for mode in ("gradscaler", "mixprec"):
        model, batches = model_and_data()
        inner_opt = INNER[inner](model.parameters())
        if mode == "gradscaler":
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        else:
            opt = LossScaleOptimizer(inner_opt, DynamicLossScale(**TORCH_RULE))
        scales, norms = [], []
        for i, (x, y) in enumerate(batches):
            loss = F.mse_loss(model(x), y)
            if mode == "gradscaler":
                scaler.scale(loss).backward()
                poison(model, i)
                scaler.unscale_(inner_opt)
            else:
                opt.scale_loss(loss).backward()
                poison(model, i)
                opt.unscale_()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            if mode == "gradscaler":
                scaler.step(inner_opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                opt.step()
                scales.append(float(opt.loss_scale))
            inner_opt.zero_grad()
        results.append((snapshot(model, inner_opt), scales, torch.stack(norms)))
    (p_ref, s_ref, n_ref), (p_mp, s_mp, n_mp) = results
    assert s_mp == s_ref and s_ref[2] < s_ref[1]  # an overflow backed the scale off
    assert torch.equal(n_mp.nan_to_num(), n_ref.nan_to_num())
    assert equal(p_mp, p_ref)


def test_unscale_twice_raises_and_step_does_not_unscale_again():
    w = torch.nn.Parameter(torch.ones(3))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), DynamicLossScale(initial_scale=8.0))
    opt.scale_loss(w.sum()).backward()
    opt.unscale_()
    assert torch.equal(w.grad, torch.ones(3))
    with pytest.raises(RuntimeError, match="already been called"):
        opt.unscale_()
    opt.step()
    assert torch.equal(w.detach(), torch.zeros(3))  # stepped by 1 * grad 1, not 1/8
    opt.zero_grad()
    opt.scale_loss(w.sum()).backward()
    opt.unscale_()  # allowed again after the step
    opt.step()


def test_unscale_with_master_weights_leaves_true_gradients_on_the_masters():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=0.5), DynamicLossScale(initial_scale=2.0**10), master_weights=True
    )
    opt.scale_loss((w.float() * 3).sum()).backward()
    opt.unscale_()
    master = opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and torch.equal(master.grad, torch.full((4,), 3.0))
    torch.nn.utils.clip_grad_norm_([master], 1.0)
    opt.step()
    assert torch.allclose(w.float(), torch.full((4,), 0.75), atol=1e-2)


# -- misuse ----------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
def test_plain_backward_then_step_raises_and_changes_nothing(inner):
    model, batches = model_and_data()
    opt = LossScaleOptimizer(INNER[inner](model.parameters()), DynamicLossScale())
    x, y = batches[0]
    opt.scale_loss(F.mse_loss(model(x), y)).backward()
    opt.step()
    opt.zero_grad()
    before = snapshot(model, opt) + [opt.loss_scale.clone(), opt.iterations]
    F.mse_loss(model(x), y).backward()  # what a trainer that ignores the scale does
    with pytest.raises(RuntimeError, match=r"scale_loss\(loss\)\.backward\(\)"):
        opt.step()
    assert equal(snapshot(model, opt) + [opt.loss_scale.clone(), opt.iterations], before)


def test_no_scale_or_a_scale_of_one_needs_no_scaled_loss():
    for loss_scale in (None, 1.0, NoOpLossScale()):
        w = torch.nn.Parameter(torch.ones(2))
        opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), loss_scale)
        w.sum().backward()
        opt.step()
        assert torch.equal(w.detach(), torch.full((2,), 0.5))


def test_optimizers_sharing_a_scale_each_accept_one_scaled_loss():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    shared = DynamicLossScale(initial_scale=4.0)
    opt_a = LossScaleOptimizer(torch.optim.SGD([a], lr=0.5), shared)
    opt_b = LossScaleOptimizer(torch.optim.SGD([b], lr=0.5), shared)
    opt_a.scale_loss((a + b).sum()).backward()  # one loss over both models
    opt_a.step()
    opt_b.step()
    assert torch.equal(a.detach(), b.detach()) and torch.equal(a.detach(), torch.full((2,), 0.5))
    (a + b).sum().backward()
    with pytest.raises(RuntimeError):
        opt_b.step()


# -- skipped steps leave the state exactly as it was -----------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
def test_a_skipped_first_step_leaves_no_state_and_training_continues_identically(inner):
    runs = []
    for skip_first in (True, False):
        model, batches = model_and_data()
        opt = LossScaleOptimizer(INNER[inner](model.parameters()), DynamicLossScale(**TORCH_RULE))
        x, y = batches[0]
        if skip_first:
            opt.scale_loss(F.mse_loss(model(x), y)).backward()
            next(model.parameters()).grad[0, 0] = float("inf")
            before = snapshot(model, opt)
            opt.step()
            opt.zero_grad()
            assert equal(snapshot(model, opt), before) and len(opt.state) == 0
            assert int(opt.skipped_steps) == 1 and int(opt.iterations) == 0
            opt.loss_scaler.scale.fill_(1024.0)  # as if the step had never been
            opt.loss_scaler.inf_streak.zero_()
        for x, y in batches[1:4]:
            opt.scale_loss(F.mse_loss(model(x), y)).backward()
            opt.step()
            opt.zero_grad()
        runs.append(snapshot(model, opt))
    assert equal(*runs)
    assert all(torch.isfinite(t).all() for t in runs[0])


@pytest.mark.parametrize("inner", list(INNER))
def test_every_later_skipped_step_leaves_parameters_and_state_bit_identical(inner):
    model, batches = model_and_data()
    opt = LossScaleOptimizer(INNER[inner](model.parameters()), DynamicLossScale(**TORCH_RULE))
    for i, (x, y) in enumerate(batches):
        opt.scale_loss(F.mse_loss(model(x), y)).backward()
        poison(model, i)
        before = snapshot(model, opt)
        opt.step()
        opt.zero_grad()
        assert equal(snapshot(model, opt), before) == (i in INFS)
    assert int(opt.skipped_steps) == len(INFS)


def test_minimize_with_an_expanded_gradient():
    var = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = tf.LossScaleOptimizer(torch.optim.SGD([var], lr=0.5))
    opt.minimize(lambda: var.sum(), [var])  # d(sum)/dvar is an expanded tensor
    assert torch.equal(var.detach(), torch.tensor([0.5, 1.5]))


# -- counters --------------------------------------------------------------------------------


def test_iterations_is_assignable_and_checked():
    w = torch.nn.Parameter(torch.ones(1))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1))
    opt.iterations = 7
    assert int(opt.iterations) == 7
    with pytest.raises(ValueError, match="iterations"):
        opt.iterations = -1
    assert int(opt.iterations) == 7


def _compiled_run(inner: str, compile_step: bool):
    torch._dynamo.reset()
    model, batches = model_and_data()
    opt = LossScaleOptimizer(INNER[inner](model.parameters()), DynamicLossScale(**TORCH_RULE))

    def train_step(x, y, overflow):
        loss = F.mse_loss(model(x), y)
        opt.scale_loss(loss).backward()
        next(model.parameters()).grad[0, 0] += overflow
        opt.step()
        opt.zero_grad()

    step = torch.compile(train_step, backend="aot_eager") if compile_step else train_step
    counters = []
    for i, (x, y) in enumerate(batches):
        step(x, y, torch.tensor(float("inf") if i in INFS else 0.0))
        counters.append(
            (int(opt.iterations), int(opt.skipped_steps), bool(opt.last_step_skipped))
        )
    return snapshot(model, opt) + [opt.loss_scale.clone()], counters


# torch 2.11's Dynamo fails inside a compiled LossScaleOptimizer.step (docs/guides/compile.md).
NEEDS_TORCH_2_13 = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="compiling the optimizer step needs torch >= 2.13",
)


@NEEDS_TORCH_2_13
@pytest.mark.parametrize("inner", ["sgd-momentum", "adamw-fused"])
def test_a_compiled_train_step_keeps_the_counters_of_eager(inner):
    eager, eager_counters = _compiled_run(inner, compile_step=False)
    compiled, compiled_counters = _compiled_run(inner, compile_step=True)
    assert compiled_counters == eager_counters
    assert eager_counters[-1] == (9 - len(INFS), len(INFS), False)
    assert eager_counters[5] == (4, 2, True)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


# -- checkpoints -----------------------------------------------------------------------------


def trained(growth_interval: int = 2, steps: int = 4):
    model, batches = model_and_data()
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        DynamicLossScale(initial_scale=1024.0, growth_interval=growth_interval),
    )
    for i, (x, y) in enumerate(batches[:steps]):
        opt.scale_loss(F.mse_loss(model(x), y)).backward()
        poison(model, i)
        opt.step()
        opt.zero_grad()
    return model, opt, batches


def test_state_dict_has_torchs_shape_and_loads_with_weights_only():
    _, opt, _ = trained()
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "mixprec"}
    assert sd["param_groups"] == opt.inner_optimizer.state_dict()["param_groups"]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    model2, opt2, _ = trained(steps=0)
    opt2.load_state_dict(loaded)
    assert torch.equal(opt2.loss_scale, opt.loss_scale)
    assert int(opt2.iterations) == int(opt.iterations) and int(opt2.skipped_steps) == 1


def test_state_dict_hooks_fire():
    _, opt, _ = trained()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert calls == ["pre", "loaded"]


def test_load_applies_the_saved_loss_scale_configuration():
    _, saved, _ = trained(growth_interval=3)
    _, opt, _ = trained(growth_interval=2000, steps=0)
    opt.load_state_dict(saved.state_dict())
    assert opt.loss_scaler.growth_interval == 3
    assert torch.equal(opt.loss_scaler.counter, saved.loss_scaler.counter)


def test_load_of_another_kind_of_scale_raises_and_changes_nothing():
    _, saved, _ = trained()
    model, batches = model_and_data()
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), 128.0)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="loss scale is 'dynamic', this one is 'static'"):
        opt.load_state_dict(saved.state_dict())
    assert equal(snapshot(model, opt), before) and float(opt.loss_scale) == 128.0


def test_a_state_dict_without_torchs_keys_is_refused_and_changes_nothing():
    _, saved, _ = trained()
    sd = saved.state_dict()
    nested = {"inner": {"state": sd["state"], "param_groups": sd["param_groups"]}, **sd["mixprec"]}
    model, opt, _ = trained(steps=0)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="expected the keys 'state' and 'param_groups'"):
        opt.load_state_dict(nested)
    assert equal(snapshot(model, opt), before)


def test_distributed_checkpoint_state_dict_round_trip():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, batches = trained()
    model_sd, optim_sd = get_state_dict(model, opt)
    assert optim_sd["state"]  # keyed by parameter names
    model_sd, optim_sd = copy.deepcopy(model_sd), copy.deepcopy(optim_sd)
    fresh_model, _ = model_and_data(seed=1)
    fresh = LossScaleOptimizer(
        torch.optim.AdamW(fresh_model.parameters(), lr=0.01),
        DynamicLossScale(initial_scale=1024.0, growth_interval=2),
    )
    # set_state_dict creates the optimizer's state with a step at learning rate 0.
    set_state_dict(fresh_model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd)
    fresh.load_state_dict({**fresh.state_dict(), "mixprec": opt.state_dict()["mixprec"]})
    assert equal(snapshot(fresh_model, fresh), snapshot(model, opt))
    for x, y in batches[4:]:
        for m, o in ((model, opt), (fresh_model, fresh)):
            o.scale_loss(F.mse_loss(m(x), y)).backward()
            o.step()
            o.zero_grad()
    assert equal(snapshot(fresh_model, fresh), snapshot(model, opt))


# -- scale collapse --------------------------------------------------------------------------


def test_a_collapsed_scale_raises_after_the_floor_and_the_patience():
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=0.1),
        DynamicLossScale(initial_scale=8.0, min_scale=1.0, collapse_after=4),
    )
    steps = 0
    with pytest.raises(ScaleCollapseError, match="collapse_after=None"):
        for steps in range(1, 50):  # noqa: B007
            opt.scale_loss(w.sum() * float("inf")).backward()
            opt.step()
            opt.zero_grad()
    # 8 -> 4 -> 2 -> 1: at the floor after 3 overflows; 4 more there are the collapse.
    assert steps == 3 + 4 and float(opt.loss_scale) == 1.0


def test_collapse_after_none_never_raises():
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=0.1),
        DynamicLossScale(initial_scale=8.0, min_scale=1.0, collapse_after=None),
    )
    for _ in range(30):
        opt.scale_loss(w.sum() * float("inf")).backward()
        opt.step()
        opt.zero_grad()
    assert int(opt.skipped_steps) == 30


@NEEDS_TORCH_2_13
def test_a_compiled_fused_step_breaks_only_where_torchs_optimizers_do():
    """torch's own ``Optimizer.step`` breaks the graph around every optimizer step
    (``_use_grad``); the wrapped step adds no break of its own."""

    def breaks(opt, model, batches, scaled: bool) -> int:
        x, y = batches[0]
        for _ in range(2):  # the first step creates the state (and reads the flag once)
            loss = F.mse_loss(model(x), y)
            (opt.scale_loss(loss) if scaled else loss).backward()
            if _ == 0:
                opt.step()
                opt.zero_grad()
        torch._dynamo.reset()
        return torch._dynamo.explain(opt.step)().graph_break_count

    model, batches = model_and_data()
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), DynamicLossScale(**TORCH_RULE)
    )
    # The two are torch's: _use_grad calls torch._dynamo.graph_break() before and after
    # the inner step (torch/optim/optimizer.py).
    assert breaks(opt, model, batches, True) == 2
    assert int(opt.iterations) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_the_foreach_unscale_equals_the_fused_kernel(dtype, bad):
    """CUDA's fused unscale kernel has no bfloat16 version; the two-pass foreach fallback
    used there gives the kernel's values and flag (compared here on the CPU kernel)."""
    from mixprec.numerics import _unscale_and_check_foreach_

    g = torch.Generator().manual_seed(0)
    kernel = [(torch.randn(5, generator=g) * 1024).to(dtype), torch.randn(3, 2, generator=g).to(dtype)]
    if bad is not None:
        kernel[1][0, 1] = bad
    fallback = [t.clone() for t in kernel]
    inv_scale = torch.tensor(1 / 1024.0)
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(kernel, found, inv_scale)
    assert torch.equal(_unscale_and_check_foreach_(fallback, inv_scale), found)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(kernel, fallback))


def test_the_monitor_option_samples_every_n_steps_and_names_an_overflow():
    model, batches = model_and_data()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), DynamicLossScale(**TORCH_RULE), monitor_every=2
    )
    for i, (x, y) in enumerate(batches[:4]):
        opt.scale_loss(F.mse_loss(model(x), y)).backward()
        if i == 2:
            next(model.parameters()).grad[0, 0] = float("inf")
        opt.step()
        if i == 2:  # the step's gradients, as the step saw them
            assert opt.gradient_monitor.nonfinite() == ["param_groups[0][0]"]
        opt.zero_grad()
    samples = opt.gradient_monitor.read_samples()
    assert [s.step for s in samples] == [1, 3]
    with pytest.raises(ValueError, match="monitor_every"):
        LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), monitor_every=0)
