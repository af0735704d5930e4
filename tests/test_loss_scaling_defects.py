"""Defects of the loss-scaling engine found by PyTorch's and Lightning's own tests, each
re-expressed here against ``torch.amp.GradScaler`` where torch has the behaviour."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from mixprec import GradScaler, LossScaleOptimizer, ScaleCollapseError, amp
from mixprec.loss_scale import DynamicLossScale, StaticLossScale
from mixprec.tools import HostSyncCounter


def sparse_embedding() -> torch.nn.Embedding:
    emb = torch.nn.Embedding(4, 2, sparse=True)
    torch.nn.init.zeros_(emb.weight)
    return emb


INDICES = torch.tensor([1, 1, 2])  # a repeated index: an uncoalesced gradient


def test_uncoalesced_sparse_gradients_are_unscaled_by_the_optimizer():
    emb = sparse_embedding()
    opt = LossScaleOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), 65536.0)
    opt.scale_loss(emb(INDICES).sum()).backward()
    assert not emb.weight.grad.is_coalesced()
    opt.unscale_()
    assert torch.equal(emb.weight.grad.to_dense()[1], torch.tensor([2.0, 2.0]))
    opt.step()
    assert torch.allclose(emb.weight[1], torch.tensor([-0.2, -0.2]))


def test_uncoalesced_sparse_gradients_are_unscaled_by_the_grad_scaler_as_by_torchs():
    weights = []
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        emb = sparse_embedding()
        sgd = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = scaler_class("cpu", init_scale=65536.0)
        scaler.scale(emb(INDICES).sum()).backward()
        scaler.unscale_(sgd)
        assert torch.equal(emb.weight.grad.to_dense()[1], torch.tensor([2.0, 2.0]))
        scaler.step(sgd)
        scaler.update()
        weights.append(emb.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_a_copied_optimizer_and_scaler_can_step(copier):
    w = torch.nn.Parameter(torch.ones(2))
    opt = copier(LossScaleOptimizer(torch.optim.SGD([w], lr=0.1)))
    copied = opt.param_groups[0]["params"][0]
    opt.scale_loss((copied * 2).sum()).backward()
    opt.step()
    assert torch.allclose(copied, torch.full((2,), 0.8))
    scaler, sgd = copier(GradScaler("cpu")), torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * 2).sum()).backward()
    scaler.step(sgd)
    scaler.update()
    assert torch.allclose(w, torch.full((2,), 0.8))


def test_a_preset_grad_scale_on_a_fused_optimizer_multiplies_the_scale_as_torchs_does():
    results = []
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        w = torch.nn.Parameter(torch.ones(4))
        sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)
        scaler = scaler_class("cpu", init_scale=4.0)
        for _ in range(2):
            sgd.grad_scale = torch.tensor(2.0)  # the caller's own factor, e.g. a loss doubled
            scaler.scale((w * 2).sum() * 2).backward()
            scaler.step(sgd)
            scaler.update()
            sgd.zero_grad()
        assert not hasattr(sgd, "grad_scale")
        results.append(w.detach().clone())
    assert torch.equal(results[0], results[1])


def test_fused_sgd_without_momentum_skips_on_the_device_after_its_first_step():
    w = torch.nn.Parameter(torch.ones(64))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1, fused=True))
    syncs = []
    for _ in range(4):
        with HostSyncCounter() as counter:
            opt.scale_loss(w.square().sum()).backward()
            opt.step()
            opt.zero_grad()
        syncs.append(counter.count)
    assert syncs == [1, 0, 0, 0]


def dropped_scaled_loss(opt_or_scaler, w):
    loss = (w * 2).sum()
    if isinstance(opt_or_scaler, LossScaleOptimizer):
        opt_or_scaler.scale_loss(loss)  # the result is dropped...
    else:
        opt_or_scaler.scale(loss)
    loss.backward()  # ...and the unscaled loss backpropagated


def test_a_dropped_scaled_loss_is_caught_at_the_step():
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1))
    dropped_scaled_loss(opt, w)
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(2)) and int(opt.iterations) == 0
    scaler, sgd = GradScaler("cpu"), torch.optim.SGD([w], lr=0.1)
    dropped_scaled_loss(scaler, w)
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        scaler.step(sgd)
    assert torch.equal(w.detach(), torch.ones(2))


def test_a_scaled_backward_through_a_larger_graph_is_accepted():
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1))
    total = opt.scale_loss((w * 2).sum()) + 0.0 * w.sum()  # the scaled loss inside a sum
    total.backward()
    opt.step()
    assert int(opt.iterations) == 1


@pytest.mark.parametrize("value", [1e39, 1e-40, float("inf")])
def test_scales_float32_cannot_hold_are_refused(value):
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError):
        LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), value)
    with pytest.raises(ValueError):
        DynamicLossScale(initial_scale=value, min_scale=None, max_scale=None)
    with pytest.raises(ValueError):
        GradScaler("cpu", init_scale=value)


def test_a_fixed_scale_that_skips_every_step_is_a_collapse():
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), StaticLossScale(1e8, collapse_after=3))
    for step in range(3):
        opt.scale_loss((w * float("inf")).sum()).backward()
        if step < 2:
            opt.step()
        else:
            with pytest.raises(ScaleCollapseError, match="fixed loss scale 1e\\+08 is too large"):
                opt.step()
        opt.zero_grad()
    assert int(opt.skipped_steps) == 3


def o2(width: int):
    net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
    return amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), "O2",
                          torch.bfloat16)  # fmt: skip


def test_a_load_whose_masters_do_not_fit_changes_nothing():
    net, opt = o2(8)
    opt.scale_loss(net(torch.randn(3, 4)).float().sum()).backward()
    opt.step()
    saved = opt.state_dict()
    _, other = o2(6)
    other.lr = 0.5
    with pytest.raises(ValueError, match=r"\['masters'\]\[0\] has shape \(8, 4\)"):
        other.load_state_dict(saved)
    assert other.lr == 0.5 and len(other.state) == 0


def test_a_grad_scaler_load_with_a_bad_state_changes_nothing():
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=5)
    saved = GradScaler("cpu", init_scale=64.0, growth_interval=3).state_dict()
    saved["mixprec"]["state"]["counter"] = torch.ones(2)
    with pytest.raises(ValueError, match="one-element"):
        scaler.load_state_dict(saved)
    assert scaler.get_growth_interval() == 5 and scaler.get_scale() == 8.0


def test_step_keyword_arguments_reach_the_inner_optimizer():
    class Noting(torch.optim.SGD):
        def step(self, closure=None, *, note=None):
            self.note = note
            return super().step(closure)

    w = torch.nn.Parameter(torch.ones(2))
    inner = Noting([w], lr=0.1)
    opt = LossScaleOptimizer(inner)
    opt.scale_loss(w.sum()).backward()
    opt.step(note="from the trainer")
    assert inner.note == "from the trainer"
