"""Data parallelism (DDP) on 2 processes, gloo, 127.0.0.1: an overflow that only one
rank sees makes every rank skip (parameters bit-identical, one loss scale), for the
``LossScaleOptimizer`` and ``mixprec.GradScaler``; ``process_group`` selects the ranks
that agree, ``"local"`` keeps the decision per rank; gradient accumulation with
``opt.no_sync(ddp)`` equals the large batch and all-reduces once per window.

All distributed checks run in one spawned pair of processes (a module fixture), each
test reads its part of the results."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import needs_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from mixprec.loss_scale import DynamicLossScale, StaticLossScale
from mixprec.optim import GradScaler, LossScaleOptimizer
from mixprec.tools import HostSyncCounter, run_on_ranks

pytestmark = needs_gloo

STEPS, BAD_STEP = 5, 2  # at BAD_STEP, rank 1 alone finds an inf in its gradient


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(rank: int, step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def overflow_locally(rank: int, step: int, net: torch.nn.Module) -> None:
    """An inf in this rank's gradient after DDP's all-reduce: what model-, tensor- or
    pipeline-parallel layouts (and FSDP's shards) produce."""
    if rank == 1 and step == BAD_STEP:
        with torch.no_grad():
            next(net.parameters()).grad[0, 0] = float("inf")


def outcome(net: torch.nn.Module, scale: torch.Tensor, skipped: int) -> dict:
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "scale": float(scale),
        "skipped": skipped,
    }


def train_lso(rank: int, process_group, fused: bool) -> dict:
    ddp = DDP(model())
    opt = LossScaleOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=fused),
        DynamicLossScale(initial_scale=2.0**10, growth_interval=1000),
        global_clipnorm=1.0,
        process_group=process_group,
    )
    syncs = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.scale_loss(F.mse_loss(ddp(x), y)).backward()
        overflow_locally(rank, step, ddp)
        with HostSyncCounter() as counter:
            opt.step()
        syncs.append(counter.count)
        opt.zero_grad()
    return {**outcome(ddp, opt.loss_scale, int(opt.skipped_steps)), "syncs": syncs}


def train_grad_scaler(rank: int) -> dict:
    """torch's recipe: unscale_, clip, step, update (the flag is all-reduced in step())."""
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    skipped = 0
    for step in range(STEPS):
        x, y = batch(rank, step)
        scaler.scale(F.mse_loss(ddp(x), y)).backward()
        overflow_locally(rank, step, ddp)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        skipped += scaler.step(opt) is None and step == BAD_STEP
        scaler.update()
        opt.zero_grad()
    return outcome(ddp, scaler.loss_scale.scale, skipped)


def grad_scaler_update_after_unscale(rank: int) -> float:
    """unscale_() without step() (a loop that inspects gradients, then skips itself):
    update() agrees on the flags, so the scales stay one."""
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    x, y = batch(rank, 0)
    scaler.scale(F.mse_loss(ddp(x), y)).backward()
    overflow_locally(rank, BAD_STEP, ddp)
    scaler.unscale_(opt)
    scaler.update()
    return float(scaler.loss_scale.scale)


def count_allreduces(ddp: DDP) -> dict:
    """Route DDP's gradient all-reduces through a hook that counts them."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter = {"calls": 0}

    def hook(state, bucket):
        counter["calls"] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return counter


def accumulate(rank: int, micro: int, windows: int, how: str) -> dict:
    """``how``: "wrapper" (opt.no_sync(ddp)), "ddp" (ddp.no_sync() on non-final
    micro-steps, the wrapper not told), or "large" (one batch of micro * 4 samples)."""
    ddp = DDP(model())
    counter = count_allreduces(ddp)
    opt = LossScaleOptimizer(
        torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
        StaticLossScale(1024.0),
        gradient_accumulation_steps=None if how == "large" else micro,
    )
    refused = None
    for w in range(windows):
        parts = [batch(rank, w * micro + k) for k in range(micro)]
        if how == "large":
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            opt.scale_loss(F.mse_loss(ddp(x), y)).backward()
            opt.step()
            opt.zero_grad()
            continue
        for k, (x, y) in enumerate(parts):
            last = k == micro - 1
            context = opt.no_sync(ddp) if how == "wrapper" else (
                ddp.no_sync() if not last else torch.enable_grad()
            )  # fmt: skip
            with context:
                opt.scale_loss(F.mse_loss(ddp(x), y)).backward()
            opt.step()
            opt.zero_grad()
            if how == "wrapper" and w == 0 and k == 0:
                try:
                    opt.state_dict()
                except RuntimeError as err:
                    refused = str(err)
    return {
        "params": [p.detach().clone() for p in ddp.parameters()],
        "allreduces": counter["calls"],
        "refused": refused,
    }


def train_master_mode(rank: int, mode: str) -> dict:
    """A bfloat16 DDP model stepped with ``mode`` master weights (held in one flat storage
    per group after DDP was built), on this rank's half of each global batch."""
    ddp = DDP(model().bfloat16())
    opt = LossScaleOptimizer(torch.optim.AdamW(ddp.parameters(), lr=0.01), None,
                             master_weights=mode)  # fmt: skip
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.scale_loss(F.mse_loss(ddp(x.bfloat16()).float(), y)).backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in ddp.parameters()]}


def one_process_master_mode(mode: str) -> list[torch.Tensor]:
    """The same training in one process on the global batch (both ranks' halves)."""
    net = model().bfloat16()
    opt = LossScaleOptimizer(torch.optim.AdamW(net.parameters(), lr=0.01), None,
                             master_weights=mode)  # fmt: skip
    for step in range(STEPS):
        x, y = (torch.cat(parts) for parts in zip(batch(0, step), batch(1, step)))
        opt.scale_loss(F.mse_loss(net(x.bfloat16()).float(), y)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def ddp_checks(rank: int) -> dict:
    results = {
        "default": train_lso(rank, None, fused=False),
        "fused": train_lso(rank, None, fused=True),
        "local": train_lso(rank, "local", fused=False),
        "whole_group": train_lso(rank, dist.new_group([0, 1]), fused=False),
        "grad_scaler": train_grad_scaler(rank),
        "update_after_unscale": grad_scaler_update_after_unscale(rank),
    }
    # A group per rank (every rank takes part in creating each): each agrees with itself.
    own = [dist.new_group([r]) for r in range(dist.get_world_size())]
    results["own_group"] = train_lso(rank, own[rank], fused=False)
    for how in ("wrapper", "ddp", "large"):
        results[f"accumulate_{how}"] = accumulate(rank, micro=3, windows=2, how=how)
    for mode in ("kahan", "split8"):
        results[mode] = train_master_mode(rank, mode)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(ddp_checks, world_size=2, timeout=180)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["default", "fused", "whole_group", "grad_scaler"])
def test_an_overflow_on_one_rank_makes_every_rank_skip(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert same(r0["params"], r1["params"])  # bit-identical
    assert r0["scale"] == r1["scale"] == 2.0**9  # backed off once, on both
    assert r0["skipped"] == r1["skipped"] == 1


def test_grad_scaler_update_agrees_on_flags_that_no_step_used(ranks):
    assert ranks[0]["update_after_unscale"] == ranks[1]["update_after_unscale"] == 2.0**9


@pytest.mark.parametrize("mode", ["kahan", "split8"])
def test_lean_and_split8_weights_train_under_ddp_as_in_one_process(ranks, mode):
    """Weights held in one flat storage after DDP was built: both replicas step alike and
    follow one process on the global batch (bfloat16 all-reduce: close, not equal)."""
    r0, r1 = ranks[0][mode]["params"], ranks[1][mode]["params"]
    assert same(r0, r1)
    reference = one_process_master_mode(mode)
    start = [p.detach() for p in model().bfloat16().parameters()]
    for p, q, s in zip(r0, reference, start):
        assert float((p.float() - s.float()).abs().max()) > 0.02  # trained: about 0.045
        assert float((p.float() - q.float()).abs().max()) < 5e-3  # measured: 0.002 at most


@pytest.mark.parametrize("case", ["local", "own_group"])
def test_a_decision_kept_per_rank_lets_the_ranks_drift(ranks, case):
    """The control: without agreement the local overflow splits the ranks, as it does
    with torch.amp.GradScaler."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert not same(r0["params"], r1["params"])
    assert (r0["scale"], r1["scale"]) == (2.0**10, 2.0**9)
    assert (r0["skipped"], r1["skipped"]) == (0, 1)


def test_a_fused_inner_step_agrees_without_a_host_sync(ranks):
    # The first step creates the fused optimizer's state (one read); then none at all.
    for rank in ranks:
        assert rank["fused"]["syncs"][1:] == [0] * (STEPS - 1)


def test_accumulation_with_no_sync_equals_the_large_batch_and_reduces_once(ranks):
    for rank in ranks:
        acc, large = rank["accumulate_wrapper"], rank["accumulate_large"]
        for a, b in zip(acc["params"], large["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert acc["allreduces"] == large["allreduces"] == 2  # one per window
    assert same(ranks[0]["accumulate_wrapper"]["params"], ranks[1]["accumulate_wrapper"]["params"])


def test_no_sync_that_the_wrapper_does_not_know_about_diverges(ranks):
    """The mistake opt.no_sync() exists for: earlier micro-batches never all-reduced."""
    assert not same(ranks[0]["accumulate_ddp"]["params"], ranks[1]["accumulate_ddp"]["params"])


def test_a_state_dict_inside_a_no_sync_window_is_refused(ranks):
    assert "inside a no_sync() accumulation window" in ranks[0]["accumulate_wrapper"]["refused"]


# -- without processes -----------------------------------------------------------------------


def test_a_bad_process_group_is_refused_and_changes_nothing():
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    groups = [dict(g) for g in inner.param_groups]
    with pytest.raises(TypeError, match="process_group must be None, 'local' or a"):
        LossScaleOptimizer(inner, process_group="everyone")
    assert [dict(g) for g in inner.param_groups] == groups
    with pytest.raises(TypeError, match="got 3"):
        GradScaler("cpu", process_group=3)


def test_without_a_process_group_nothing_is_reduced():
    net = model()
    opt = LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = batch(0, 0)
    opt.scale_loss(F.mse_loss(net(x), y)).backward()
    opt.step()  # would fail on an uninitialised group if it tried to all-reduce
    assert int(opt.iterations) == 1


def test_no_sync_needs_accumulation_and_a_ddp_or_fsdp2_module():
    net = model()
    plain = LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=N"), plain.no_sync(net):
        pass
    acc = LossScaleOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), gradient_accumulation_steps=2
    )
    with pytest.raises(TypeError, match="got Sequential"), acc.no_sync(net):
        pass
