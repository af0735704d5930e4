"""One loss scale shared by several optimizers behaves as one ``torch.amp.GradScaler``
used with several optimizers: each optimizer unscales by the scale its loss was
multiplied by and skips only its own overflowing step
the scale moves once per
iteration from all their verdicts. Compared bit for bit with torch's scaler."""

from __future__ import annotations

import copy
import pickle

import torch

from mixprec import DynamicLossScale, LossScaleOptimizer


def grad_scaler_like(initial_scale: float = 2.0**16, growth_interval: int = 2):
    """The DynamicLossScale whose sequence is GradScaler's (no floor, no ceiling)."""
    return DynamicLossScale(
        initial_scale=initial_scale, growth_interval=growth_interval,
        min_scale=None, max_scale=None,
    )  # fmt: skip


def two_models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def losses(model0, model1, x, y):
    """torch's AMP examples: two models, two losses that each mix both outputs."""
    out0, out1 = model0(x), model1(x)
    mse = torch.nn.functional.mse_loss
    return mse(2 * out0 + 3 * out1, y), mse(3 * out0 - 5 * out1, y)


def poison(model) -> None:
    model.weight.grad[0, 0] = float("inf")


# Iterations where model0's gradients overflow, and where model1's do.
OVERFLOW0, OVERFLOW1 = {1, 4}, {4, 6}


def bits(*models) -> list[torch.Tensor]:
    return [p.detach().clone() for m in models for p in m.parameters()]


def test_torch_multiple_models_losses_and_optimizers_loop_ports_bit_for_bit():
    data = batches(8)
    # torch.amp.GradScaler with two optimizers, scaler.update() once per iteration.
    t0, t1 = two_models()
    topt0 = torch.optim.SGD(t0.parameters(), lr=0.1, momentum=0.9)
    topt1 = torch.optim.Adam(t1.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    torch_scales = []
    for i, (x, y) in enumerate(data):
        topt0.zero_grad()
        topt1.zero_grad()
        loss0, loss1 = losses(t0, t1, x, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i in OVERFLOW0:
            poison(t0)
        if i in OVERFLOW1:
            poison(t1)
        scaler.unscale_(topt0)  # the recipe's clip of one optimizer's gradients
        torch.nn.utils.clip_grad_norm_(t0.parameters(), 1.0)
        scaler.step(topt0)
        scaler.step(topt1)
        scaler.update()
        torch_scales.append(scaler.get_scale())

    m0, m1 = two_models()
    shared = grad_scaler_like()
    opt0 = LossScaleOptimizer(torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.9), shared)
    opt1 = LossScaleOptimizer(torch.optim.Adam(m1.parameters(), lr=0.01), shared)
    scales = []
    for i, (x, y) in enumerate(data):
        opt0.zero_grad()
        opt1.zero_grad()
        loss0, loss1 = losses(m0, m1, x, y)
        opt0.scale_loss(loss0).backward(retain_graph=True)
        opt1.scale_loss(loss1).backward()
        if i in OVERFLOW0:
            poison(m0)
        if i in OVERFLOW1:
            poison(m1)
        opt0.unscale_()
        torch.nn.utils.clip_grad_norm_(m0.parameters(), 1.0)
        opt0.step()
        opt1.step()
        scales.append(float(shared.scale))
    assert scales == torch_scales
    for mine, theirs in zip(bits(m0, m1), bits(t0, t1)):
        assert torch.equal(mine, theirs)
    # Each optimizer skipped only its own overflows.
    assert int(opt0.skipped_steps) == len(OVERFLOW0)
    assert int(opt1.skipped_steps) == len(OVERFLOW1)


def test_the_second_optimizer_unscales_by_the_scale_its_loss_was_multiplied_by():
    w0, w1 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    scale = DynamicLossScale(initial_scale=1024.0)
    opt0 = LossScaleOptimizer(torch.optim.SGD([w0], lr=1.0), loss_scale=scale)
    opt1 = LossScaleOptimizer(torch.optim.SGD([w1], lr=1.0), loss_scale=scale)
    opt0.scale_loss((w0 * float("inf")).sum() + (w1 * 1.0).sum()).backward()
    opt0.step()
    opt1.step()

    t0, t1 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    topt0, topt1 = torch.optim.SGD([t0], lr=1.0), torch.optim.SGD([t1], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((t0 * float("inf")).sum() + (t1 * 1.0).sum()).backward()
    scaler.step(topt0)
    scaler.step(topt1)
    scaler.update()

    assert torch.equal(w0.detach(), t0.detach()) and torch.equal(w1.detach(), t1.detach())
    assert float(w1.detach()) == 0.0  # stepped by the true gradient 1, not 2
    assert float(scale.scale) == scaler.get_scale() == 512.0  # backed off once


def test_update_after_each_step_loops_match_grad_scaler_updating_after_each_step():
    """A GAN-style loop (one loss scaled, one optimizer stepped, then the next): the
    verdict of each step moves the scale before the next loss is scaled, as
    ``scaler.update()`` after every ``scaler.step()`` does."""
    data = batches(6)
    t0, t1 = two_models()
    topt0, topt1 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (t0, t1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    m0, m1 = two_models()
    shared = grad_scaler_like(2.0**10, growth_interval=1)
    opt0, opt1 = (LossScaleOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), shared)
                  for m in (m0, m1))  # fmt: skip
    for i, (x, y) in enumerate(data):
        for k, (tm, topt, mm, opt) in enumerate(((t0, topt0, m0, opt0), (t1, topt1, m1, opt1))):
            topt.zero_grad()
            opt.zero_grad()
            scaler.scale(losses(t0, t1, x, y)[k]).backward()
            opt.scale_loss(losses(m0, m1, x, y)[k]).backward()
            if (i + k) % 3 == 0:
                poison(tm)
                poison(mm)
            scaler.step(topt)
            scaler.update()
            opt.step()
    shared.settle()
    assert float(shared.scale) == scaler.get_scale()
    for mine, theirs in zip(bits(m0, m1), bits(t0, t1)):
        assert torch.equal(mine, theirs)


def test_copies_share_their_copied_scale_and_a_checkpoint_holds_the_settled_scale():
    m0, m1 = two_models()
    shared = grad_scaler_like(1024.0)
    opt0 = LossScaleOptimizer(torch.optim.SGD(m0.parameters(), lr=0.1), shared)
    opt1 = LossScaleOptimizer(torch.optim.SGD(m1.parameters(), lr=0.1), shared)
    pair = copy.deepcopy((opt0, opt1))
    assert pair[0].loss_scaler is pair[1].loss_scaler is not shared
    restored = pickle.loads(pickle.dumps((opt0, opt1)))
    x, y = batches(1)[0]
    # Model 0 overflows: opt0 alone has stepped, the verdict waits for opt1 ...
    opt0.scale_loss(sum(losses(m0, m1, x, y))).backward()
    poison(m0)
    opt0.step()
    assert float(shared.scale) == 1024.0
    # ... until the state is saved: a checkpoint holds the scale that the next loss gets.
    assert float(shared.state_dict()["scale"]) == 512.0
    opt1.step()
    assert float(shared.scale) == 512.0  # backed off once, not again for opt1
    for a, b in (pair, restored):
        a.loss_scaler.update_after(a, torch.tensor(1.0))
        assert float(a.loss_scaler.scale) == 1024.0  # its partner has not stepped
        a.loss_scaler.update_after(b, torch.tensor(0.0))
        assert float(a.loss_scaler.scale) == 512.0
