"""fp32 master weights (master_weights=True): float16/bfloat16 model, float32 copies
stepped by the inner optimizer, gradients unscaled in float32, results copied back;
checkpoints hold the masters; the memory it costs, measured and checked."""

from __future__ import annotations

import io

import pytest
import torch

from mixprec.compat.tf import TFOptimizerAPI
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer

KINDS = {
    "noop": NoOpLossScale,
    "static": lambda: StaticLossScale(1024.0),
    "dynamic": lambda: DynamicLossScale(initial_scale=1024.0, growth_interval=1000),
}
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
}
LOW = [torch.float16, torch.bfloat16]


def masters_of(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def tiny_mlp(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model.to(dtype)


def batch(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g).to(dtype), torch.randn(8, 2, generator=g)


def train_step(opt, model, seed: int, overflow: bool = False) -> None:
    x, y = batch(seed, next(model.parameters()).dtype)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)  # loss in float32
    opt.scale_loss(loss).backward()
    if overflow:
        model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()


# -- structure ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW)
def test_inner_optimizer_holds_float32_masters_and_float32_params_stand_for_themselves(dtype):
    low = torch.nn.Parameter(torch.randn(3, 2).to(dtype))
    norm = torch.nn.Parameter(torch.ones(2))  # a float32 layer kept in float32
    inner = torch.optim.Adam([low, norm], lr=1e-3)
    opt = LossScaleOptimizer(inner, master_weights=True)
    m_low, m_norm = masters_of(opt)
    assert opt.master_weights
    assert m_low.dtype == torch.float32 and m_low is not low
    assert torch.equal(m_low, low.detach().float())
    assert m_norm is norm
    assert [id(p) for p in inner.param_groups[0]["params"]] == [id(m_low), id(m_norm)]


# -- the update, against a float32 optimizer ---------------------------------------------


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", LOW)
def test_masters_follow_a_float32_optimizer_bit_for_bit(dtype, kind, optimizer):
    gen = torch.Generator().manual_seed(3)
    # Values that float16 and bfloat16 hold exactly, scaled or not (scales are powers of 2).
    init = torch.randint(-64, 64, (5, 3), generator=gen).float() / 64
    grads = [torch.randint(-128, 128, (5, 3), generator=gen).float() / 256 for _ in range(4)]
    w = torch.nn.Parameter(init.to(dtype))
    ref = torch.nn.Parameter(init.clone())
    opt = LossScaleOptimizer(
        OPTIMIZERS[optimizer]([w]), loss_scale=KINDS[kind](), master_weights=True
    )
    ref_opt = OPTIMIZERS[optimizer]([ref])
    for g in grads:
        w.grad = (g * opt.loss_scale).to(dtype)  # what backward of the scaled loss gives
        opt.loss_scaler.mark_scaled()
        opt.step()
        opt.zero_grad()
        ref.grad = g
        ref_opt.step()
        assert torch.equal(w.detach(), ref.detach().to(dtype))  # copied back after every step
    master = masters_of(opt)[0]
    assert torch.equal(master, ref.detach())
    state = opt.state[master]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    assert all(torch.equal(v, ref_opt.state[ref][k]) for k, v in state.items())


@pytest.mark.parametrize("path", ["step", "minimize"])
def test_gradients_are_unscaled_in_float32_not_in_float16(path):
    # True gradient 2**-26: far below float16's smallest subnormal (2**-24), but
    # 2**-11 once scaled by 2**15. Only a float32 unscale keeps it.
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    # minimize is TensorFlow's method: the core optimizer with the compat.tf methods mixed in.
    cls = LossScaleOptimizer if path == "step" else type("Opt", (TFOptimizerAPI, LossScaleOptimizer), {})
    opt = cls(
        torch.optim.SGD([w], lr=2.0**16), loss_scale=StaticLossScale(2.0**15), master_weights=True
    )
    c = torch.full((4,), 2.0**-12, dtype=torch.float16)

    def loss():
        return (w * c).sum() * 2.0**-14

    if path == "step":
        opt.scale_loss(loss()).backward()
        assert w.grad.dtype == torch.float16 and torch.equal(
            w.grad, torch.full((4,), 2.0**-11, dtype=torch.float16)
        )
        opt.step()
        assert torch.equal(masters_of(opt)[0].grad, torch.full((4,), 2.0**-26))
    else:
        opt.minimize(loss, [w])
    # lr * grad = 2**16 * 2**-26 = 2**-10.
    assert torch.equal(masters_of(opt)[0], torch.full((4,), 1.0 - 2.0**-10))
    assert torch.equal(w.detach(), torch.full((4,), 1.0 - 2.0**-10, dtype=torch.float16))


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_overflowing_float16_gradient_skips_the_step_and_changes_nothing(kind):
    model = tiny_mlp(torch.float16)
    opt = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), loss_scale=KINDS[kind](), master_weights=True
    )
    train_step(opt, model, seed=0)
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in masters_of(opt)]
    state = {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    train_step(opt, model, seed=1, overflow=True)
    assert bool(opt.last_step_skipped) and int(opt.iterations) == 1
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), params))
    assert all(torch.equal(m, b) for m, b in zip(masters_of(opt), masters))
    after = {(i, k): v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


# -- stall without masters, learning with them (measured) ----------------------------------


def regression(dtype: torch.dtype, use_masters: bool, optimizer: str, steps: int = 60):
    """Fit y = x @ 1 from w = 1.5 with every update below float16's resolution at 1.5."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(64, 8, generator=gen) * 2 - 1
    y = x @ torch.full((8,), 1.0)
    w = torch.nn.Parameter(torch.full((8,), 1.5, dtype=dtype))
    if optimizer == "sgd":
        inner = torch.optim.SGD([w], lr=5e-4)
    else:
        inner = torch.optim.Adam([w], lr=2e-4)
    opt = LossScaleOptimizer(inner, loss_scale=StaticLossScale(256.0), master_weights=use_masters)
    xl = x.to(dtype)
    stepped = masters_of(opt)[0]

    def eval_loss() -> float:  # measured in float32 from the model's own weights
        return float(torch.nn.functional.mse_loss(x @ w.detach().float(), y))

    losses, ratios = [eval_loss()], []
    for _ in range(steps):
        before = stepped.detach().float().clone()
        loss = torch.nn.functional.mse_loss((xl @ w).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        if use_masters:  # the update each step made, relative to the weight
            ratios.append(float(((stepped.detach() - before).abs() / before.abs()).max()))
        losses.append(eval_loss())
    return w.detach().clone(), losses, ratios


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", LOW)
def test_tiny_updates_stall_in_low_precision_and_learn_with_masters(dtype, optimizer):
    w0 = torch.full((8,), 1.5, dtype=dtype)
    w_plain, loss_plain, _ = regression(dtype, use_masters=False, optimizer=optimizer)
    w_master, loss_master, ratios = regression(dtype, use_masters=True, optimizer=optimizer)
    resolution = 2.0**-11 if dtype == torch.float16 else 2.0**-8  # half an ulp, relative
    # Every update is below the weights' resolution ...
    assert max(ratios) < resolution, (max(ratios), resolution)
    # ... so without masters not one bit of the weights changes and the loss is flat,
    assert torch.equal(w_plain, w0), w_plain
    assert len(set(loss_plain)) == 1, (loss_plain[0], loss_plain[-1])
    # ... while with masters the weights move and the loss goes down.
    assert not torch.equal(w_master, w0)
    assert loss_master[-1] < loss_master[0] * 0.99, (loss_master[0], loss_master[-1])


# -- checkpoints -------------------------------------------------------------------------


def build_everything(model):
    return LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=3e-3),
        loss_scale=DynamicLossScale(initial_scale=2.0**12, growth_interval=3),
        master_weights=True,
        global_clipnorm=5.0,
        weight_decay=0.01,
        use_ema=True,
        ema_momentum=0.9,
        gradient_accumulation_steps=2,
    )


def everything(opt, model) -> list[torch.Tensor]:
    sd = opt.state_dict()
    inner = [v for s in sd["state"].values() for v in s.values()]
    own = sd["mixprec"]
    scale = list(own["loss_scale"]["state"].values())
    counters = list(own["counters"].values())
    acc = [s for s in own["accumulation"]["sums"] if s is not None]
    return (
        [p.detach() for p in model.parameters()]
        + [m.detach() for m in masters_of(opt)]
        + inner
        + scale
        + counters
        + own["ema"]["averages"]
        + acc
    )


@pytest.mark.parametrize("dtype", LOW)
def test_a_restored_checkpoint_continues_bit_for_bit(dtype):
    model = tiny_mlp(dtype)
    opt = build_everything(model)
    for i in range(9):  # four windows and half of a fifth, one of them overflowing
        train_step(opt, model, seed=i, overflow=i == 4)
    assert int(opt.skipped_steps) == 1 and int(opt.iterations) == 3
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    saved = ckpt["opt"]["mixprec"]["master"]["masters"]
    assert all(m.dtype == torch.float32 for m in saved)
    assert all(torch.equal(s, m) for s, m in zip(saved, masters_of(opt)))
    # The masters carry bits the low-precision model does not: rebuilding them from the
    # model would lose information.
    assert any(not torch.equal(m, p.detach().float()) for m, p in zip(saved, model.parameters()))

    fresh = tiny_mlp(dtype, seed=123)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt = build_everything(fresh)
    fresh_opt.load_state_dict(ckpt["opt"])
    assert all(
        torch.equal(a, b) for a, b in zip(everything(opt, model), everything(fresh_opt, fresh))
    )
    for i in range(9, 16):
        train_step(opt, model, seed=i, overflow=i == 12)
        train_step(fresh_opt, fresh, seed=i, overflow=i == 12)
    a, b = everything(opt, model), everything(fresh_opt, fresh)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert int(fresh_opt.iterations) == 6 and int(fresh_opt.skipped_steps) == 2


# -- validation --------------------------------------------------------------------------


def test_master_weights_with_only_float32_parameters_raise_and_leave_the_inner_optimizer_alone():
    model = tiny_mlp(torch.float32)
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(0, torch.float32)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    params = list(inner.param_groups[0]["params"])
    ids = [id(p) for p in params]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in inner.state.items()}
    with pytest.raises(ValueError, match="master_weights=True needs float16 or bfloat16.*float32"):
        LossScaleOptimizer(inner, master_weights=True)
    assert [id(p) for p in inner.param_groups[0]["params"]] == ids
    assert all(p.dtype == torch.float32 for p in params)
    assert {id(p) for p in inner.state} == set(state)
    assert all(
        torch.equal(v, state[id(p)][k]) for p, s in inner.state.items() for k, v in s.items()
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clipnorm": 1.0, "global_clipnorm": 1.0},
        {"gradient_accumulation_steps": -2},
        {"use_ema": True, "ema_momentum": 2.0},
    ],
    ids=["two-clipnorms", "negative-accumulation", "bad-ema"],
)
def test_a_rejected_master_weights_optimizer_does_not_swap_in_masters(kwargs):
    model = tiny_mlp(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError):
        LossScaleOptimizer(inner, master_weights=True, **kwargs)
    # The inner optimizer still steps the model's own float16 parameters.
    assert [id(p) for p in inner.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert all(p.dtype == torch.float16 for p in inner.param_groups[0]["params"])


# -- memory (measured) -------------------------------------------------------------------


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_memory_of_parameters_and_adam_state_with_and_without_masters():
    n_in = 3162
    numel = n_in * n_in + n_in  # weight + bias: 10,001,406 parameters
    step_bytes = 2 * 4  # Adam keeps one float32 scalar "step" per parameter tensor
    results = {}
    for name, dtype, masters in [
        ("fp32 params", torch.float32, False),
        ("bf16 params + fp32 masters", torch.bfloat16, True),
    ]:
        torch.manual_seed(0)
        model = torch.nn.Linear(n_in, n_in, dtype=dtype)
        opt = LossScaleOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3),
            loss_scale=NoOpLossScale(),
            master_weights=masters,
        )
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        assert int(opt.iterations) == 1
        model_ids = {id(p) for p in model.parameters()}
        param_bytes = nbytes(model.parameters())
        master_bytes = nbytes(m for m in masters_of(opt) if id(m) not in model_ids)
        state_bytes = nbytes(v for s in opt.state.values() for v in s.values())
        results[name] = (param_bytes, master_bytes, state_bytes)
        del model, opt
    # bytes of (parameters, master weights, Adam's state) after one step
    assert results["fp32 params"] == (4 * numel, 0, 8 * numel + step_bytes)
    assert results["bf16 params + fp32 masters"] == (2 * numel, 4 * numel, 8 * numel + step_bytes)
    assert sum(results["fp32 params"]) == 120_016_880
    assert sum(results["bf16 params + fp32 masters"]) == 140_019_692


def _o2_run(reuse: bool, steps: int = 4, freeze_head_at: int = 2):
    """O2 bfloat16 training of a small MLP; the head's gradient is missing at one step."""
    from mixprec import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                level="O2", dtype=torch.bfloat16)  # fmt: skip
    opt._master.reuses_gradient_views = reuse
    g = torch.Generator().manual_seed(1)
    freed = []
    for step in range(steps):
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.scale_loss(loss).backward()
        if step == freeze_head_at:
            model[2].weight.grad = None  # a parameter without a gradient this step
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(m.grad is None for m in opt._master.masters)
        freed.append([flat.untyped_storage().nbytes() for _, flat, _ in opt._master._grad_views.values()])
    return [p.detach().clone() for p in model.parameters()], freed


def test_master_gradient_views_kept_between_steps_change_nothing_and_hold_no_memory():
    """The masters' gradients are views of one buffer kept from step to step: training
    is bit-identical to fresh views every step, including a step where a parameter has
    no gradient, and zero_grad leaves the buffer's storage freed (nothing held between
    steps)."""
    kept, freed = _o2_run(reuse=True)
    fresh, none_kept = _o2_run(reuse=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))
    assert none_kept == [[]] * 4
    assert freed and all(sizes and all(n == 0 for n in sizes) for sizes in freed)


@pytest.mark.parametrize("flat", [True, False])
def test_an_unscaled_bfloat16_o2_step_skips_on_an_inf_in_any_gradient(flat, monkeypatch):
    """Unscaled bfloat16 O2 checks, on a CPU, the masters' gradient buffer after the copy
    (``flat``), else (a GPU, or a CPU under a dispatch mode: the GPU's way, see
    :func:`mixprec.numerics.cpu_shortcuts`) the model's gradients: either way a step
    with an inf in any gradient is skipped, and the steps around one where a parameter
    had no gradient (a buffer made for the others, then the whole one again) are not."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec import amp
    from mixprec.optim.masters import MasterWeights

    class Watched(TorchDispatchMode):  # runs each op as it is
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    checked = []
    original = MasterWeights.gradients_to_check

    def spy(self):
        tensors = original(self)
        checked.append(sorted(t.numel() for t in tensors if t is not None))
        return tensors

    monkeypatch.setattr(MasterWeights, "gradients_to_check", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))  # fmt: skip
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                level="O2", dtype=torch.bfloat16)  # fmt: skip
    poison = {1: model[0].weight, 3: model[1].weight, 5: model[3].bias, 6: model[0].bias}
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.scale_loss(torch.nn.functional.cross_entropy(model(x).float(), y)).backward()
        if step == 4:
            model[3].weight.grad = None
        if step in poison:
            poison[step].grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        with contextlib.nullcontext() if flat else Watched():
            opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        assert bool(opt.last_step_skipped) == (step in poison) and moved == (step not in poison)
    sizes = sorted(p.numel() for p in model.parameters())
    assert checked[0] == (sorted([48 + 8 + 24 + 3] + [8, 8]) if flat else sizes)
    no_head = [n for n in sizes if n != 24]  # step 4: the head's weight has no gradient
    assert checked[4] == (sorted([48 + 8 + 3] + [8, 8]) if flat else no_head)


# -- groups added later ------------------------------------------------------------------

ADDED_MODES = ["fp32", "split", "split8", "kahan", "stochastic"]


def _two_groups(mode: str, late: bool):
    """A bfloat16 MLP whose second layer is a group of its own: added after the
    optimizer was built (from a generator, as ``module.parameters()`` gives) or not."""
    model = tiny_mlp(torch.bfloat16)
    first = [{"params": list(model[0].parameters())}]
    second = {"params": model[2].parameters(), "lr": 3e-3}
    inner = torch.optim.AdamW(first if late else first + [second], lr=1e-3)
    opt = LossScaleOptimizer(inner, loss_scale=None, master_weights=mode)
    if late:
        opt.add_param_group(second)
    return model, opt


@pytest.mark.parametrize("mode", ADDED_MODES)
def test_a_group_added_later_steps_as_one_given_up_front(mode):
    (late, late_opt), (early, early_opt) = _two_groups(mode, True), _two_groups(mode, False)
    weight = late[2].weight.detach().clone()
    for seed in range(3):
        train_step(late_opt, late, seed)
        train_step(early_opt, early, seed)
    assert not torch.equal(late[2].weight, weight)
    for a, b in zip(late.parameters(), early.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ADDED_MODES)
@pytest.mark.parametrize(
    "bad, error, match",
    [
        (lambda m: {"params": [m[0].weight]}, ValueError, "already steps"),
        (lambda m: {"params": [m[2].weight, m[2].weight]}, ValueError, "repeats a parameter"),
        (lambda m: {"params": set(m[2].parameters())}, TypeError, "is a set"),
        (lambda m: {"params": [m[2].weight * 2]}, ValueError, "non-leaf"),
        (lambda m: {"params": ["weight"]}, TypeError, "holds a str"),
        (lambda m: {"lr": 0.1}, ValueError, "no 'params' entry"),
    ],
    ids=["in-another-group", "twice", "set", "non-leaf", "not-a-tensor", "no-params"],
)
def test_a_bad_group_is_refused_and_changes_nothing(mode, bad, error, match):
    """The inner optimizer sees masters or lean views, not the model's parameters, so
    the wrapper refuses what torch's optimizers refuse before anything takes them on."""
    model, opt = _two_groups(mode, True)
    twin, twin_opt = _two_groups(mode, True)
    with pytest.raises(error, match=match):
        opt.add_param_group(bad(model))
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    for seed in range(2):
        train_step(opt, model, seed)
        train_step(twin_opt, twin, seed)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
