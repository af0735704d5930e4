"""Sharded data parallelism on 2 processes (gloo, 127.0.0.1): FSDP2 (``fully_shard``,
DTensor parameters) with master weights, clipping and EMA matches one process on the
same global batch; clipping uses the whole model's norms; FSDP1 (flat parameters)
skips a step whole when one rank's shard overflows; distributed checkpoints
(``torch.distributed.checkpoint``) resume exactly; what cannot work says so.

All distributed checks run in one spawned pair of processes (a module fixture), each
test reads its part of the results."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import needs_gloo

from mixprec.loss_scale import DynamicLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.tools import run_on_ranks

pytestmark = needs_gloo

STEPS, BAD_STEP = 5, 2  # at BAD_STEP one rank's shard of the gradients holds an inf
CASES = {  # name: (parameter dtype, LossScaleOptimizer options)
    "mw_clip_ema": (
        torch.bfloat16,
        {"master_weights": True, "global_clipnorm": 0.05, "use_ema": True},
    ),
    "global_clipnorm": (torch.float32, {"global_clipnorm": 0.05}),
    "clipnorm": (torch.float32, {"clipnorm": 0.02, "use_ema": True}),
}


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return net.to(dtype)


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32, n: int = 4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randn(n, 3, generator=g)


def global_batch(step: int, dtype: torch.dtype):
    parts = [batch(r, step, dtype) for r in range(2)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def optimizer(net, options: dict, process_group=None) -> LossScaleOptimizer:
    # SGD: its update is the clipped gradient itself (Adam would undo a global rescale).
    return LossScaleOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9),
        DynamicLossScale(initial_scale=2.0**10, growth_interval=1000),
        process_group=process_group,
        **options,
    )


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def poison(grad: torch.Tensor) -> None:
    """An inf in this rank's part of ``grad`` (its local shard under FSDP)."""
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.view(-1)[0] = float("inf")


def run(net, opt, step_batch, poisoned: bool, steps: int = STEPS, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = step_batch(step)
        opt.scale_loss(F.mse_loss(net(x).float(), y)).backward()
        if poisoned and step == BAD_STEP:
            poison(next(p for p in net.parameters() if p.grad is not None).grad)
        opt.step()
        opt.zero_grad()


def summary(params, opt) -> dict:
    return {
        "params": [full(p) for p in params],
        "ema": [full(a) for a in opt._ema.averages] if opt.use_ema else [],
        "scale": float(opt.loss_scale),
        "skipped": int(opt.skipped_steps),
    }


def fsdp2(dtype: torch.dtype) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # CPU even beside a GPU
    net = model(dtype)
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def fsdp1(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model(dtype), device_id=torch.device("cpu"), use_orig_params=False)


def fsdp1_params(net) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(net):
        return [p.detach().clone() for p in net.parameters()]


def reference(dtype, options) -> dict:
    """One process, the global batch, no process group (the opt-out keeps it local)."""
    net = model(dtype)
    opt = optimizer(net, options, process_group="local")
    run(net, opt, lambda step: global_batch(step, dtype), poisoned=True)
    return summary(net.parameters(), opt)


def fsdp2_case(rank: int, name: str) -> dict:
    dtype, options = CASES[name]
    net = fsdp2(dtype)
    opt = optimizer(net, options)
    run(net, opt, lambda step: batch(rank, step, dtype), poisoned=rank == 1)
    return {"fsdp": summary(net.parameters(), opt), "reference": reference(dtype, options)}


FSDP1_CASES = {  # name: (parameter dtype, LossScaleOptimizer options)
    "fsdp1": (torch.float32, {"global_clipnorm": 0.05}),
    "fsdp1_mw": (
        torch.bfloat16,
        {"master_weights": True, "global_clipnorm": 0.05, "use_ema": True},
    ),
}


def fsdp1_case(rank: int, name: str, process_group=None) -> dict:
    dtype, options = FSDP1_CASES[name]
    net = fsdp1(dtype)
    opt = optimizer(net, options, process_group=process_group)
    run(net, opt, lambda step: batch(rank, step, dtype), poisoned=rank == 1)
    return {**summary([], opt), "params": fsdp1_params(net)}


def accumulate_fsdp2(rank: int, micro: int = 3, windows: int = 2) -> dict:
    """``opt.no_sync(fsdp)`` over micro-batches, beside one large batch per window."""
    params, held = {}, []
    for how in ("no_sync", "large"):
        net = fsdp2(torch.float32)
        opt = optimizer(net, {"gradient_accumulation_steps": micro if how == "no_sync" else None})
        for w in range(windows):
            parts = [batch(rank, w * micro + k) for k in range(micro)]
            if how == "large":
                parts = [tuple(torch.cat(t) for t in zip(*parts))]
            for x, y in parts:
                with opt.no_sync(net) if how == "no_sync" else torch.enable_grad():
                    opt.scale_loss(F.mse_loss(net(x), y)).backward()
                if how == "no_sync":  # FSDP2 holds unreduced gradients until the last
                    held.append(all(p.grad is None for p in net.parameters()))
                opt.step()
                opt.zero_grad()
        params[how] = [full(p) for p in net.parameters()]
    return {**params, "held": held}


def refusals() -> dict:
    from mixprec.optim import CheckpointState

    found = {}
    net = fsdp1()
    for key, attempt in {
        "fsdp1_clipnorm": lambda: optimizer(net, {"clipnorm": 1.0}),
        "fsdp1_no_sync": lambda: (
            optimizer(net, {"gradient_accumulation_steps": 2}).no_sync(net).__enter__()
        ),
        "fsdp1_ema_checkpoint": lambda: CheckpointState(
            net, optimizer(net, {"use_ema": True})
        ).state_dict(),
    }.items():
        try:
            attempt()
            found[key] = None
        except NotImplementedError as err:
            found[key] = str(err)
    return found


def resume(rank: int, build, dtype, options: dict, folder: str) -> dict:
    """Save after 3 steps with DCP, go on 3 steps; a fresh run loads and goes on the same 3."""
    import torch.distributed.checkpoint as dcp

    from mixprec.optim import CheckpointState

    def step_batch(step):
        return batch(rank, step, dtype)

    net = build(dtype)
    opt = optimizer(net, options)
    run(net, opt, step_batch, poisoned=rank == 1, steps=3)
    dcp.save({"train": CheckpointState(net, opt)}, checkpoint_id=folder)
    run(net, opt, step_batch, poisoned=False, steps=3, first=3)
    fresh = build(dtype)
    fresh_opt = optimizer(fresh, options)
    dcp.load({"train": CheckpointState(fresh, fresh_opt)}, checkpoint_id=folder)
    run(fresh, fresh_opt, step_batch, poisoned=False, steps=3, first=3)
    params = fsdp1_params if build is fsdp1 else (lambda n: [full(p) for p in n.parameters()])
    return {
        "saved": {**summary([], opt), "params": params(net), "iterations": int(opt.iterations)},
        "loaded": {
            **summary([], fresh_opt),
            "params": params(fresh),
            "iterations": int(fresh_opt.iterations),
        },
        "ema": [
            torch.equal(a, b)
            for a, b in zip(summary([], opt)["ema"], summary([], fresh_opt)["ema"])
        ],
    }


def fsdp_checks(rank: int, folder: str) -> dict:
    results = {name: fsdp2_case(rank, name) for name in CASES}
    for name, (dtype, options) in FSDP1_CASES.items():
        results[name] = {"fsdp": fsdp1_case(rank, name), "reference": reference(dtype, options)}
    results["fsdp1_local"] = fsdp1_case(rank, "fsdp1", process_group="local")
    results["refusals"] = refusals()
    results["accumulate"] = accumulate_fsdp2(rank)
    mw = {"master_weights": True, "use_ema": True, "global_clipnorm": 0.05}
    results["resume_fsdp2_mw"] = resume(rank, fsdp2, torch.bfloat16, mw, f"{folder}/fsdp2_mw")
    ema = {"use_ema": True, "clipnorm": 0.02}
    results["resume_fsdp2"] = resume(rank, fsdp2, torch.float32, ema, f"{folder}/fsdp2")
    results["resume_fsdp1"] = resume(rank, fsdp1, torch.float32, {}, f"{folder}/fsdp1")
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    return run_on_ranks(fsdp_checks, str(folder), world_size=2, timeout=240)


def assert_close_all(a, b, **tolerance) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), **tolerance)


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_matches_one_process_on_the_global_batch(ranks, name):
    """Every rank skips BAD_STEP (one rank's shard overflowed), as the reference does,
    and the rest matches: clipping saw the whole model's norms, not a shard's."""
    tolerance = {"rtol": 0, "atol": 4e-3} if CASES[name][0] is torch.bfloat16 else {}
    for rank in ranks:
        got, want = rank[name]["fsdp"], rank[name]["reference"]
        assert got["skipped"] == want["skipped"] == 1
        assert got["scale"] == want["scale"] == 2.0**9
        assert_close_all(got["params"], want["params"], **tolerance)
        assert_close_all(got["ema"], want["ema"], **tolerance)
    # The gathered parameters are one model: both ranks see the same values.
    assert all(
        torch.equal(a, b)
        for a, b in zip(ranks[0][name]["fsdp"]["params"], ranks[1][name]["fsdp"]["params"])
    )


def test_fsdp2_per_tensor_clipping_is_per_whole_tensor(ranks):
    """The control for clipnorm: the clip was active (clipping changed the result)."""
    unclipped = [p for p in ranks[0]["global_clipnorm"]["reference"]["params"]]
    clipped = ranks[0]["clipnorm"]["reference"]["params"]
    assert not all(torch.allclose(a, b) for a, b in zip(unclipped, clipped))


@pytest.mark.parametrize("name", list(FSDP1_CASES))
def test_fsdp1_skips_the_whole_step_when_one_shard_overflows(ranks, name):
    """Flat parameters, with master weights too: the step is skipped on every rank,
    the global norm is the whole model's, and the result is one process's."""
    tolerance = {"rtol": 0, "atol": 4e-3} if FSDP1_CASES[name][0] is torch.bfloat16 else {}
    for rank in ranks:
        got, want = rank[name]["fsdp"], rank[name]["reference"]
        assert got["skipped"] == want["skipped"] == 1
        assert got["scale"] == want["scale"] == 2.0**9
        assert_close_all(got["params"], want["params"], **tolerance)


def test_fsdp1_without_agreement_applies_part_of_a_step(ranks):
    """The control: rank 0 applies its shard, rank 1 skips; the scales part."""
    r0, r1 = ranks[0]["fsdp1_local"], ranks[1]["fsdp1_local"]
    assert (r0["skipped"], r1["skipped"]) == (0, 1)
    assert (r0["scale"], r1["scale"]) == (2.0**10, 2.0**9)
    want = ranks[0]["fsdp1"]["reference"]["params"]
    assert not all(torch.allclose(a, b) for a, b in zip(r0["params"], want))


def test_fsdp2_accumulation_with_no_sync_equals_the_large_batch(ranks):
    for rank in ranks:
        result = rank["accumulate"]
        assert result["held"] == [True, True, False] * 2  # reduced once per window
        assert_close_all(result["no_sync"], result["large"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["resume_fsdp2_mw", "resume_fsdp2", "resume_fsdp1"])
def test_a_distributed_checkpoint_resumes_exactly(ranks, case):
    for rank in ranks:
        saved, loaded = rank[case]["saved"], rank[case]["loaded"]
        assert all(torch.equal(a, b) for a, b in zip(saved["params"], loaded["params"]))
        assert len(saved["params"]) == 4
        assert (saved["scale"], saved["skipped"], saved["iterations"]) == (
            loaded["scale"], loaded["skipped"], loaded["iterations"]
        )  # fmt: skip
        assert saved["skipped"] == 1 and saved["iterations"] == 5
        assert all(rank[case]["ema"])


@pytest.mark.parametrize(
    "key, words",
    [
        ("fsdp1_clipnorm", "clipnorm=1.0 with FSDP1"),
        ("fsdp1_no_sync", "opt.no_sync() with FSDP1"),
        ("fsdp1_ema_checkpoint", "checkpoint of EMA on FSDP1 flat parameters"),
    ],
)
def test_what_torch_cannot_do_is_named(ranks, key, words):
    assert words in ranks[0]["refusals"][key]
