"""mixprec.integrations.accelerate in a real Accelerate loop, against mixprec's own loop.

Same seed, data, level (O2 bfloat16, float32 masters), loss scale and LR schedule;
one step per epoch overflows (an inf in the data) and is skipped on both sides, the
schedule does not advance on it, and ``accelerator.clip_grad_norm_`` clips. The
weights agree bit for bit, and ``save_state``/``load_state`` continue exactly.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate", reason="needs the [hf] extra: pip install -e '.[hf]'")

from accelerate import Accelerator  # noqa: E402

from mixprec import DynamicLossScale, GradScaler, LossScaleOptimizer, amp, loss_scale_from_spec  # noqa: E402
from mixprec.integrations.accelerate import LossScaleOptimizerScaler, prepare_amp  # noqa: E402

BATCH, CLIP, LR, EPOCHS, STEPS = 4, 0.05, 0.1, 2, 12
pytestmark = pytest.mark.usefixtures("one_thread")


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def make_loss_scale() -> DynamicLossScale:
    return DynamicLossScale(initial_scale=256.0, growth_interval=2)


def make_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g)
    x[9, 3] = float("inf")  # batch 2 of every epoch overflows
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / STEPS)


def reference():
    """mixprec's own loop; the schedule advances on applied steps only."""
    net = make_net()
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    net, opt = amp.initialize(net, sgd, "O2", torch.bfloat16, loss_scale=make_loss_scale())
    sched = schedule(opt)
    for _ in range(EPOCHS):
        for x, y in make_loader():
            opt.scale_loss(F.mse_loss(net(x), y)).backward()
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], CLIP)
            opt.step()
            if not opt.last_step_skipped:
                sched.step()
            opt.zero_grad()
    return net, opt, sched


def prepared():
    accelerator = Accelerator(cpu=True)
    net = make_net()
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    sched = schedule(sgd)
    net, opt = prepare_amp(
        accelerator, net, sgd, level="O2", dtype=torch.bfloat16, loss_scale=make_loss_scale()
    )
    return accelerator, *accelerator.prepare(net, opt, make_loader(), sched)


def train_epoch(accelerator, net, opt, loader, sched):
    skipped = []
    for x, y in loader:
        accelerator.backward(F.mse_loss(net(x), y))
        accelerator.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
    return skipped


def assert_same(net, opt, ref_net, ref_opt):
    for mine, theirs in zip(net.parameters(), ref_net.parameters(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    inner = opt.optimizer
    assert isinstance(inner, LossScaleOptimizer)
    assert float(inner.loss_scale) == float(ref_opt.loss_scale)
    assert int(inner.skipped_steps) == int(ref_opt.skipped_steps) == EPOCHS
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_an_accelerate_loop_matches_mixprecs_loop_and_resumes_exactly(tmp_path):
    ref_net, ref_opt, ref_sched = reference()
    accelerator, net, opt, loader, sched = prepared()
    assert isinstance(accelerator.scaler, LossScaleOptimizerScaler)
    overflow_at_2 = [i == 2 for i in range(STEPS // EPOCHS)]
    assert train_epoch(accelerator, net, opt, loader, sched) == overflow_at_2
    accelerator.save_state(tmp_path / "state")
    train_epoch(accelerator, net, opt, loader, sched)
    assert_same(net, opt, ref_net, ref_opt)
    assert ref_sched.last_epoch == sched.scheduler.last_epoch == STEPS - EPOCHS

    accelerator2, net2, opt2, loader2, sched2 = prepared()
    accelerator2.load_state(tmp_path / "state")
    assert net2[0].weight.dtype == torch.bfloat16
    train_epoch(accelerator2, net2, opt2, loader2, sched2)
    assert_same(net2, opt2, ref_net, ref_opt)
    assert accelerator2.scaler.state_dict()["scale"] == float(ref_opt.loss_scale)
    # What loops that log the scale read, as of torch's GradScaler: the live scale.
    assert accelerator2.scaler.get_scale() == float(ref_opt.loss_scale)
    assert accelerator2.scaler._scale is opt2.optimizer.loss_scaler.scale


def test_a_step_dropped_after_clipping_unscales_the_next_batch_again():
    """``zero_grad()`` after ``clip_grad_norm_`` drops the step (a norm spike); the next
    batch's clipping must see its own unscaled gradients, as mixprec's own loop does."""
    accelerator, net, opt, loader, _ = prepared()
    ref = make_net()
    ref, ref_opt = amp.initialize(ref, torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9),
                                  "O2", torch.bfloat16, loss_scale=make_loss_scale())  # fmt: skip
    norms, ref_norms = [], []
    for step, (x, y) in enumerate(loader):
        if step == 2:  # the overflowing batch
            break
        accelerator.backward(F.mse_loss(net(x), y))
        norms.append(float(accelerator.clip_grad_norm_(net.parameters(), CLIP)))
        ref_opt.scale_loss(F.mse_loss(ref(x), y)).backward()
        ref_opt.unscale_()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        if step == 0:  # drop the first step
            opt.zero_grad()
            ref_opt.zero_grad()
            continue
        opt.step()
        ref_opt.step()
    assert norms == ref_norms and norms[1] < 100  # true gradients, not scaled by 256
    for mine, theirs in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_accelerate_reports_the_verdict_the_step_goes_by():
    """Accelerate learns whether a step was skipped from the verdict ``unscale_()`` took,
    the one the step goes by, not from a second check of the gradients: gradients that
    a hook made finite after the check are still a skipped step, on both sides."""
    accelerator, net, opt, loader, _ = prepared()
    inner = opt.optimizer
    x, y = next(iter(loader))
    assert inner.unscaled_found_inf is None
    accelerator.backward(F.mse_loss(net(x), y) * float("inf"))
    accelerator.unscale_gradients()
    assert float(inner.unscaled_found_inf) == 1.0
    for p in net.parameters():  # made finite after the verdict was taken
        p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    assert accelerator.optimizer_step_was_skipped
    assert int(inner.skipped_steps) == 1 and inner.unscaled_found_inf is None
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))


def test_gradients_from_an_unscaled_backward_are_refused():
    accelerator, net, opt, loader, _ = prepared()
    x, y = next(iter(loader))
    F.mse_loss(net(x), y).backward()  # not accelerator.backward: the loss was never scaled
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_prepare_amp_checks_the_accelerator_and_its_order():
    net = make_net()
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        prepare_amp(object(), net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator, net, opt, _, _ = prepared()
    with pytest.raises(ValueError, match="comes before accelerator.prepare"):
        prepare_amp(accelerator, make_net(), opt)
    plain = Accelerator(cpu=True)
    plain_opt = plain.prepare(torch.optim.SGD(make_net().parameters(), lr=0.1))
    late = make_net()
    with pytest.raises(ValueError, match="prepared an optimizer that prepare_amp"):
        prepare_amp(plain, late, torch.optim.SGD(late.parameters(), lr=0.1))
    assert plain.scaler is None and plain_opt.scaler is None
    other = make_net()
    with pytest.raises(ValueError, match="share the loss scale"):
        prepare_amp(accelerator, other, torch.optim.SGD(other.parameters(), lr=0.1), loss_scale=8.0)
    assert amp.get_policy(other) is None  # refused before the model changed


def test_a_scaler_checkpoint_of_another_kind_changes_nothing():
    scaler = LossScaleOptimizerScaler(make_loss_scale())
    before = scaler.state_dict()
    torch_like = GradScaler("cpu").state_dict()
    del torch_like["mixprec"]
    with pytest.raises(ValueError, match="no 'mixprec' key"):
        scaler.load_state_dict(torch_like)
    static = LossScaleOptimizerScaler(loss_scale_from_spec(8.0)).state_dict()
    with pytest.raises(ValueError, match="resume with the same kind of loss scale"):
        scaler.load_state_dict(static)
    assert scaler.state_dict()["mixprec"]["config"] == before["mixprec"]["config"]
    assert float(scaler.loss_scale.scale) == before["scale"]


def test_a_missing_accelerate_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "mixprec.integrations.accelerate")
    with pytest.raises(ImportError, match=r'pip install -e "\.\[hf\]"'):
        importlib.import_module("mixprec.integrations.accelerate")
