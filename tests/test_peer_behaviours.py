"""Behaviours that PyTorch's own GradScaler tests check, re-expressed against mixprec's
public interface, side by side with ``torch.amp.GradScaler`` where torch has them:
a ``grad_scale`` set on a fused optimizer, torch's deprecated ``grad_scaler`` step
argument, the private members other libraries read, overflow checks over mixed
gradient dtypes and layouts, and a scale that cannot grow past float32. Last, the
front end's counterpart of a refused load: ``Model.train(resume=...)`` with a
checkpoint that does not fit changes nothing before it raises."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec import DynamicLossScale, Model
from mixprec.train import CheckpointError
from mixprec.train.callbacks import ModelCheckpoint
from mixprec.train.models import MLP

pytestmark = pytest.mark.usefixtures("one_thread")

SCALERS = {"torch": torch.amp.GradScaler, "mixprec": mixprec.GradScaler}


def fused(name: str, params) -> torch.optim.Optimizer:
    if name == "adagrad":  # its state exists from construction: no first-step special case
        return torch.optim.Adagrad(params, lr=0.1, fused=True)
    return torch.optim.Adam(params, lr=0.1, fused=True)


def weight_with_grad(value: float) -> torch.nn.Parameter:
    weight = torch.nn.Parameter(torch.ones(2, 3))
    weight.grad = torch.full_like(weight, value)
    return weight


@pytest.mark.parametrize("warm_steps", [0, 1])
@pytest.mark.parametrize("opt_name", ["adagrad", "adam"])
def test_a_preset_grad_scale_after_unscale_is_all_the_fused_kernel_divides_by(opt_name, warm_steps):
    """Unscaled by ``unscale_``, the gradients are divided in the kernel only by the
    ``grad_scale`` the caller set; the scaler's own scale is not applied twice, and the
    caller's value is not dropped."""
    runs = {}
    for kind, cls in SCALERS.items():
        weight = weight_with_grad(0.0)
        opt = fused(opt_name, [weight])
        scaler = cls("cpu", init_scale=5.0)
        for _ in range(warm_steps):  # Adam's state exists after a step
            scaler.scale(weight.sum()).backward()
            scaler.step(opt)
            scaler.update()
        weight.grad = torch.full_like(weight, 15.0)
        scaler.scale(torch.ones(1))  # a loss was scaled this iteration
        scaler.unscale_(opt)
        assert torch.equal(weight.grad, torch.full_like(weight, 3.0))
        opt.grad_scale = torch.tensor([3.0])
        scaler.step(opt)
        # Whether the step consumes the attribute is the torch version's business (2.13's
        # does; 2.11's fused Adagrad keeps it): the drop-in must do what torch's does.
        runs[kind] = (weight.grad.clone(), weight.detach().clone(), hasattr(opt, "grad_scale"))
    assert torch.equal(runs["mixprec"][0], torch.full((2, 3), 1.0))
    assert runs["mixprec"][2] == runs["torch"][2]
    for mine, theirs in zip(runs["mixprec"][:2], runs["torch"][:2]):
        assert torch.equal(mine, theirs)


def test_a_preset_grad_scale_is_consumed_by_a_skipped_step_as_torchs_is():
    """A first fused step that overflows is skipped (mixprec on the host, so that it
    leaves no state behind); the caller's ``grad_scale`` belonged to that step and does
    not carry over to the next one."""
    left = {}
    for kind, cls in SCALERS.items():
        weight = weight_with_grad(0.0)
        opt = fused("adam", [weight])
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale(torch.ones(1))
        weight.grad = torch.full_like(weight, math.inf)
        opt.grad_scale = torch.tensor([2.0])
        scaler.step(opt)
        scaler.update()
        left[kind] = (hasattr(opt, "grad_scale"), scaler.get_scale())
    assert left["mixprec"] == left["torch"] == (False, 2.0)


def test_an_optimizer_taking_grad_scaler_is_refused_and_nothing_changes():
    """torch's deprecated protocol hands the scaler to ``step(grad_scaler=)`` and lets the
    optimizer unscale through torch's private methods; mixprec refuses it rather than
    stepping on scaled, unchecked gradients."""

    class TakesTheScaler(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.5)
            self._step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):
            return super().step(closure)

    weight = weight_with_grad(0.0)
    opt = TakesTheScaler([weight])
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    scaler.scale((weight * 2).sum()).backward()
    before = (weight.detach().clone(), weight.grad.clone(), scaler.state_dict())
    with pytest.raises(TypeError, match=r"TakesTheScaler\.step takes a grad_scaler argument"):
        scaler.step(opt)
    assert torch.equal(weight, before[0]) and torch.equal(weight.grad, before[1])
    assert scaler.state_dict() == before[2]
    # The iteration can still be finished by hand: the scaler was left as it was.
    scaler.unscale_(opt)
    assert torch.equal(weight.grad, torch.full_like(weight, 2.0))


def test_private_scale_reads_as_torchs_does():
    """``_scale`` (read by logging code to avoid a host sync): None until a loss is
    scaled, then the live scale tensor. mixprec's cannot be assigned, and is None when
    disabled (torch's disabled scaler has no such attribute)."""
    for cls in SCALERS.values():
        scaler = cls("cpu", init_scale=8.0, growth_interval=1)
        assert scaler._scale is None
        weight = weight_with_grad(0.0)
        opt = torch.optim.SGD([weight], lr=0.1)
        scaler.scale(weight.sum()).backward()
        assert float(scaler._scale) == 8.0
        scaler.step(opt)
        scaler.update()
        assert float(scaler._scale) == 16.0 == scaler.get_scale()
    assert mixprec.GradScaler("cpu", enabled=False)._scale is None
    with pytest.raises(AttributeError):
        mixprec.GradScaler("cpu")._scale = torch.tensor(2.0)  # type: ignore[misc]


@pytest.mark.parametrize("another_rank_overflowed", [False, True])
def test_found_inf_per_device_is_the_live_flag_the_step_goes_by_as_torchs_is(
    another_rank_overflowed,
):
    """Data-parallel loops all-reduce ``scaler._found_inf_per_device(opt)`` with MAX
    between ``unscale_()`` and ``step()`` so that every rank skips together, and read it
    after ``step()`` to learn whether the step was skipped. Here the reduction's result
    is written in place, as an all-reduce writes it."""
    outcomes = {}
    for kind, cls in SCALERS.items():
        scaler = cls("cpu", init_scale=8.0)
        weight = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([weight], lr=0.5)
        assert scaler._found_inf_per_device(opt) == {}
        scaler.scale((weight * 2).sum()).backward()
        scaler.unscale_(opt)
        flags = scaler._found_inf_per_device(opt)
        assert [float(flag) for flag in flags.values()] == [0.0]
        for flag in flags.values():
            flag.fill_(float(another_rank_overflowed))
        scaler.step(opt)
        after_step = [float(flag) for flag in scaler._found_inf_per_device(opt).values()]
        scaler.update()
        outcomes[kind] = (weight.tolist(), after_step, scaler.get_scale(),
                          scaler._found_inf_per_device(opt))  # fmt: skip
    moved = [1.0, 1.0] if another_rank_overflowed else [0.0, 0.0]
    assert outcomes["mixprec"] == outcomes["torch"]
    assert outcomes["torch"] == (moved, [float(another_rank_overflowed)],
                                 4.0 if another_rank_overflowed else 8.0, {})  # fmt: skip


def test_check_inf_per_device_flags_an_inf_and_leaves_the_gradients_scaled_as_torchs_does():
    """Custom fused optimizers and overflow monitors call ``_check_inf_per_device``."""
    for cls in SCALERS.values():
        scaler = cls("cpu", init_scale=8.0)
        weight = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([weight], lr=0.5)
        scaler.scale((weight * 2).sum()).backward()
        assert [float(f) for f in scaler._check_inf_per_device(opt).values()] == [0.0]
        assert weight.grad.tolist() == [16.0, 16.0]  # still scaled
        weight.grad[0] = math.inf
        assert [float(f) for f in scaler._check_inf_per_device(opt).values()] == [1.0]
        scaler.step(opt)  # unscales, finds the inf again, skips
        scaler.update()
        assert weight.tolist() == [1.0, 1.0] and scaler.get_scale() == 4.0
    with pytest.raises(RuntimeError, match="disabled"):
        mixprec.GradScaler("cpu", enabled=False)._check_inf_per_device(opt)
    assert mixprec.GradScaler("cpu", enabled=False)._found_inf_per_device(opt) == {}


def test_lazy_init_after_a_load_keeps_the_loaded_state_as_torchs_does():
    """Accelerate loads a scaler's state and then calls ``_lazy_init_scale_growth_tracker
    (scaler._device)`` before any loss is scaled (its FSDP2 path)."""
    source = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    weight = weight_with_grad(0.0)
    opt = torch.optim.SGD([weight], lr=0.1)
    for grad in (1.0, math.inf, 1.0):  # scale 64 -> 32, and a growth tracker of 1
        source.scale(torch.ones(1))
        weight.grad = torch.full_like(weight, grad)
        source.step(opt)
        source.update()
    saved = source.state_dict()
    scales = {}
    for kind, cls in SCALERS.items():
        scaler = cls("cpu", init_scale=1.0, growth_interval=2)
        scaler.load_state_dict(copy.deepcopy(saved))
        scaler._lazy_init_scale_growth_tracker(scaler._device)
        assert float(scaler._scale) == 32.0
        weight = weight_with_grad(0.0)
        opt = torch.optim.SGD([weight], lr=0.1)
        scaler.scale(weight.sum()).backward()
        scaler.step(opt)
        scaler.update()  # the loaded tracker's second finite step: the scale grows
        scales[kind] = scaler.get_scale()
    assert scales["mixprec"] == scales["torch"] == 64.0


@pytest.mark.parametrize("inject", [None, 0, 1, 2, 3])
def test_unscale_finds_an_inf_in_any_gradient_of_mixed_dtypes_and_layouts(inject):
    """float32 and float16 gradients, contiguous and strided, unscaled together: an inf in
    any one of them skips the step; with none, every gradient is divided by the scale."""
    base = torch.full((4, 4), 4.0)
    grads = [base.clone(), base.clone()[:, :2], base.half(), base.half().t()]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    if inject is not None:
        grads[inject][1, 1] = math.inf
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(1))
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    if inject is None:
        assert scaler.get_scale() == 4.0
        for p in params:
            assert torch.equal(p.grad, torch.ones_like(p.grad))
            assert torch.equal(p.detach(), -torch.ones_like(p))
    else:
        assert scaler.get_scale() == 2.0
        assert all(not p.detach().any() for p in params)  # skipped


def test_a_scale_near_the_float32_limit_does_not_grow_to_inf_as_torchs_does():
    scales = {}
    for kind, cls in SCALERS.items():
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 1)
        opt = torch.optim.Adam(model.parameters())
        scaler = cls("cpu", growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
        loss = ((model(torch.randn(1, 5)) - 1e-30) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales[kind] = scaler.get_scale()
    assert math.isfinite(scales["mixprec"])
    assert scales["mixprec"] == scales["torch"]


def tiny_loader(features: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, features, generator=g), torch.randint(0, 3, (16,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def tiny_model(hidden: int, optimizer: str = "adamw") -> Model:
    torch.manual_seed(hidden)
    net = MLP(8, hidden=(hidden,), num_classes=3)
    opt = (torch.optim.AdamW(net.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(net.parameters(), lr=0.1))  # fmt: skip
    scale = DynamicLossScale(initial_scale=2.0**10, growth_interval=1)  # grows every step
    return Model(net, optimizer=opt, amp_level="O2", dtype=torch.bfloat16, loss_scale=scale)


def snapshot(model: Model) -> tuple:
    state = model.optimizer.state_dict()
    return (
        [p.detach().clone() for p in model.network.parameters()],
        copy.deepcopy(state),
        float(model.optimizer.loss_scale),
    )


def assert_unchanged(before: tuple, model: Model) -> None:
    params, state, scale = before
    for old, new in zip(params, model.network.parameters(), strict=True):
        assert torch.equal(old, new)
    now = model.optimizer.state_dict()

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    assert same(state, now)
    assert float(model.optimizer.loss_scale) == scale


@pytest.mark.parametrize(
    "other, match",
    [
        # another width: the first differing parameter is named with both shapes
        (
            {"hidden": 6},
            r"epoch0001\.pt does not fit this model: layers\.1\.weight has shape "
            r"\[5, 8\] in the checkpoint and \[6, 8\] here",
        ),
        # the same network, another optimizer: its state is what does not fit
        (
            {"hidden": 5, "optimizer": "sgd"},
            r"epoch0001\.pt does not fit this model's optimizer: "
            r"the checkpoint's parameter group 0 has settings "
            r"'amsgrad', 'betas', .* which this SGD has not",
        ),
    ],
)
def test_a_resume_that_does_not_fit_changes_nothing_before_raising(tmp_path, other, match):
    loader = tiny_loader()
    tiny_model(5).train(1, loader, callbacks=[ModelCheckpoint(tmp_path)])
    model = tiny_model(**other)
    model.train(1, loader)  # trained: optimizer state, masters and a grown scale to keep
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        model.train(2, loader, resume=tmp_path / "epoch0001.pt")
    assert_unchanged(before, model)
