"""Every mixprec training path on a CPU and on a CUDA device.

Each test runs on ``cpu`` and, where a CUDA device is present, on ``cuda``:

* every amp level (O0, O1, O2, O3, lean) in float16 and bfloat16 trains with fused
  AdamW, stores its parameters in the dtype the level documents and steps without a
  host sync from the second step on;
* every O2 master-weight mode (``False``, ``"fp32"``, ``"split"``, ``"split8"``,
  ``"kahan"``, ``"stochastic"`` for bfloat16; those allowed for float16) trains and
  steps without a host sync;
* the graph rewrite in float16 and bfloat16 trains under ``LossScaleOptimizer``;
* float8: ``scaled_mm`` equals a float32 product of the dequantised inputs, and O2 with
  ``fp8=True`` trains (on CUDA only on devices with float8 units, compute capability
  8.9 and up, where ``torch._scaled_mm`` must be the kernel used);
* DDP on two ranks (gloo, 127.0.0.1; both ranks on ``cuda:0`` for the CUDA case): an
  overflow on one rank makes both skip, the replicas stay bit-identical and follow one
  process trained on the whole batch.

"No host sync" is checked with :class:`mixprec.tools.HostSyncCounter` on both devices
and, on CUDA, with ``torch.cuda.set_sync_debug_mode("error")`` as well, which also
catches synchronising kernels (such as ``nonzero``) that never read a value back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from gloo import needs_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mixprec import LossScaleOptimizer, amp
from mixprec.float8 import Float8Linear, native_scaled_mm, scaled_mm
from mixprec.loss_scale import DynamicLossScale
from mixprec.rewrite import rewrite
from mixprec.tools import HostSyncCounter, run_on_ranks

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]
CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
FLOAT8_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"),
        pytest.mark.skipif(
            not HAS_CUDA or torch.cuda.get_device_capability() < (8, 9),
            reason="needs float8 units (compute capability 8.9 or more)",
        ),
    ],
)
FLOAT8_DEVICES = ["cpu", FLOAT8_CUDA]

LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}
F32 = torch.float32


# -- helpers ---------------------------------------------------------------------------------


def mlp(device: str, out: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, out)).to(device)


def task(device: str, n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: the class is the sign of the first feature."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x.to(device), (x[:, 0] > 0).long().to(device)


def adamw(params, dtype: torch.dtype | None = None, lr: float = 1e-2) -> torch.optim.AdamW:
    """Fused AdamW; ``eps=1e-4`` where its state may be float16 (1e-8 rounds to 0 there)."""
    eps = 1e-4 if dtype == torch.float16 else 1e-8
    return torch.optim.AdamW(params, lr=lr, eps=eps, fused=True)


@contextlib.contextmanager
def no_host_sync(device: str, check: bool = True) -> Iterator[HostSyncCounter]:
    """Count host syncs in the block (reads back and device-to-host copies); on CUDA with
    ``check`` any synchronising call also raises. The debug mode is always restored."""
    with HostSyncCounter() as counter:
        if device == "cuda" and check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield counter
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")


def train(model: nn.Module, opt, device: str, steps: int, out: int = 10) -> tuple[list, list]:
    """``steps`` steps on :func:`task`; returns (losses, host syncs of each step)."""
    x, y = task(device)
    losses, syncs = [], []
    for i in range(steps):
        logits = model(x)
        assert logits.dtype == F32  # every level hands back float32 outputs
        loss = F.cross_entropy(logits, y)
        opt.scale_loss(loss).backward()
        # The first step creates the fused optimizer's state and reads the overflow
        # flag once (a skipped first step must leave no state behind); later steps never.
        with no_host_sync(device, check=i > 0) as counter:
            opt.step()
            opt.zero_grad()
        syncs.append(counter.count)
        losses.append(loss.detach())
    return [float(v) for v in losses], syncs


def assert_trained(losses: list[float], factor: float = 0.5) -> None:
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < factor * losses[0], losses


# -- 1. every level in float16 and bfloat16 --------------------------------------------------

LEVELS = ["O0", "O1", "O2", "O3", "lean"]
# level -> (model parameter dtype is low, default master weights, loss scale in float16)
LEVEL_FACTS = {
    "O0": (False, False, "none"),
    "O1": (False, False, "dynamic"),
    "O2": (True, True, "dynamic"),  # True: float32 masters ("fp32")
    "O3": (True, False, "none"),
    "lean": (True, "kahan", "none"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", LEVELS)
def test_every_level_trains_in_its_dtype_without_host_syncs(device, dtype, level):
    low = LOW[dtype]
    model = mlp(device)
    model, opt = amp.initialize(model, adamw(model.parameters(), low), level, low)
    is_low, masters, fp16_scale = LEVEL_FACTS[level]
    want = low if is_low else F32
    assert [p.dtype for p in model.parameters()] == [want] * 4
    assert all(p.device.type == device for p in model.parameters())
    assert opt.master_weights == masters
    stepped = {p.dtype for g in opt.param_groups for p in g["params"]}
    assert stepped == ({F32} if masters is True or not is_low else {low})
    assert opt.loss_scaler.kind == (fp16_scale if low == torch.float16 else "none")

    losses, syncs = train(model, opt, device, steps=20)
    assert_trained(losses)
    assert syncs[1:] == [0] * 19, syncs
    assert int(opt.iterations) == 20 and int(opt.skipped_steps) == 0
    assert [p.dtype for p in model.parameters()] == [want] * 4  # still, after training


# -- 2. every O2 master-weight mode ----------------------------------------------------------

MASTER_MODES = [
    *(("bfloat16", mode) for mode in (False, "fp32", "split", "split8", "kahan", "stochastic")),
    *(("float16", mode) for mode in (False, "fp32", "kahan")),
]


def test_the_master_modes_listed_are_those_initialize_accepts():
    """The list above follows amp.initialize: the bfloat16-only modes are refused in float16."""
    for mode in ("split", "split8", "stochastic"):
        model = mlp("cpu")
        with pytest.raises(ValueError, match="bfloat16"):
            amp.initialize(model, adamw(model.parameters()), "O2", torch.float16,
                           master_weights=mode)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "mode"), MASTER_MODES)
def test_every_o2_master_weight_mode_trains_without_host_syncs(device, dtype, mode):
    low = LOW[dtype]
    model = mlp(device)
    model, opt = amp.initialize(model, adamw(model.parameters(), low), "O2", low,
                                master_weights=mode)  # fmt: skip
    assert opt.master_weights == (True if mode == "fp32" else mode)
    assert all(p.dtype == low for p in model.parameters())

    losses, syncs = train(model, opt, device, steps=20)
    assert_trained(losses)
    assert syncs[1:] == [0] * 19, syncs
    assert all(p.dtype == low and p.device.type == device for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- 3. the graph rewrite --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rewrite_trains_with_a_loss_scale_optimizer(device, dtype):
    low = LOW[dtype]
    model = mlp(device)
    x, _ = task(device)
    graph = rewrite(model, (x[:8],), dtype=low)
    scale = "dynamic" if low == torch.float16 else "none"
    opt = LossScaleOptimizer(adamw(model.parameters()), scale)
    assert opt.loss_scaler.kind == scale
    assert all(p.dtype == F32 for p in graph.parameters())  # float32 masters, cast inside

    losses, syncs = train(graph, opt, device, steps=20)
    assert_trained(losses)
    assert syncs[1:] == [0] * 19, syncs
    assert int(opt.skipped_steps) == 0


# -- 4. float8 -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", FLOAT8_DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_equals_the_dequantised_product(device, out_dtype):
    if device == "cuda":  # a GPU with float8 units must use the kernel, not the emulation
        assert native_scaled_mm("cuda")
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 48, generator=g) * 3).to(device)
    b = (torch.randn(32, 48, generator=g) / 5).to(device)  # (N, K): b.t() is column-major
    e4m3 = torch.finfo(torch.float8_e4m3fn).max
    scale_a, scale_b = a.abs().max() / e4m3, b.abs().max() / e4m3
    a8 = (a / scale_a).to(torch.float8_e4m3fn)
    b8 = (b / scale_b).to(torch.float8_e4m3fn).t()
    out = scaled_mm(a8, b8, scale_a, scale_b, out_dtype)
    assert out.dtype == out_dtype and out.shape == (64, 32) and out.device.type == device
    reference = (a8.float() * scale_a) @ (b8.float() * scale_b)
    error = float((out.float() - reference).norm() / reference.norm())
    # float32 out: the products are exact; on the GPU the float8 kernel's accumulation
    # is coarser than float32's (about 1e-4 on an H100), on a CPU it is float32's
    assert error < (1e-3 if out_dtype == F32 else 1e-2), error
    # and the float8 product is close to the float32 one it stands for
    assert float((reference - a @ b.t()).norm() / (a @ b.t()).norm()) < 0.1


@pytest.mark.parametrize("device", FLOAT8_DEVICES)
def test_o2_with_float8_trains(device):
    model = mlp(device, out=16)  # every dimension a multiple of 16: both layers convert
    model, opt = amp.initialize(model, adamw(model.parameters()), "O2", torch.bfloat16, fp8=True)
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    assert model[0].weight.dtype == torch.bfloat16 and opt.master_weights is True

    losses, _ = train(model, opt, device, steps=20)
    assert_trained(losses)
    assert int(opt.skipped_steps) == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- 5. DDP on two ranks ---------------------------------------------------------------------

DDP_STEPS, BAD_STEP, HALF = 6, 3, 16  # at BAD_STEP rank 1 alone finds an inf in its gradient


def ddp_training(device: str, rank: int | None) -> dict:
    """Train :func:`mlp` with fused AdamW and a dynamic loss scale: under DDP on
    ``rank``'s half of each global batch, or (``rank=None``) in one process on the whole
    batch. An inf lands in a gradient at ``BAD_STEP`` (on rank 1 only, after DDP's
    all-reduce; in one process, on its own gradient)."""
    model = mlp(device)
    net: nn.Module = model
    if rank is not None:
        net = DDP(model, device_ids=[0] if device == "cuda" else None)
    opt = LossScaleOptimizer(
        adamw(net.parameters()), DynamicLossScale(initial_scale=2.0**10, growth_interval=1000)
    )
    losses = []
    for step in range(DDP_STEPS):
        x, y = task(device, n=2 * HALF, seed=step)
        if rank is not None:
            x, y = x[rank * HALF : (rank + 1) * HALF], y[rank * HALF : (rank + 1) * HALF]
        loss = F.cross_entropy(net(x), y)
        opt.scale_loss(loss).backward()
        if step == BAD_STEP and rank in (1, None):
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "params": [p.detach().cpu().clone() for p in model.parameters()],
        "device": next(model.parameters()).device.type,
        "scale": float(opt.loss_scale),
        "skipped": int(opt.skipped_steps),
        "iterations": int(opt.iterations),
        "losses": losses,
    }


def ddp_rank(rank: int, device: str) -> dict:
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU
    return ddp_training(device, rank)


@needs_gloo
@pytest.mark.parametrize("device", DEVICES)
def test_ddp_ranks_skip_together_and_match_one_process(device):
    ranks = run_on_ranks(ddp_rank, device, world_size=2, timeout=240)
    r0, r1 = ranks
    assert r0["device"] == r1["device"] == device
    for r in ranks:
        assert r["skipped"] == 1 and r["iterations"] == DDP_STEPS - 1
        assert r["scale"] == 2.0**9  # backed off once
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))  # bit-identical

    one = ddp_training(device, None)
    assert one["skipped"] == 1 and one["scale"] == 2.0**9
    start = [p.detach().cpu() for p in mlp("cpu").parameters()]
    for p, q, s in zip(r0["params"], one["params"], start):
        assert float((p - s).abs().max()) > 1e-2  # trained
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # each rank's loss is its half's; their mean is the whole batch's
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    torch.testing.assert_close(
        torch.tensor(mean), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5
    )


# -- 6. a model moved after initialize ---------------------------------------------------------


@pytest.mark.gpu
@CUDA_ONLY
def test_a_model_moved_to_the_gpu_after_initialize_trains_and_its_masters_follow():
    """accelerate's prepare() moves the model after amp.initialize: the float32 masters
    follow their weights to the GPU at the next step instead of failing there."""
    model = mlp("cpu")
    model, opt = amp.initialize(model, adamw(model.parameters()), "O2", torch.bfloat16)
    model.cuda()
    losses, syncs = train(model, opt, "cuda", steps=20)
    assert_trained(losses)
    assert syncs[1:] == [0] * 19, syncs
    inner = [p for g in opt.inner_optimizer.param_groups for p in g["params"]]
    assert all(m.device.type == "cuda" and m.dtype == F32 for m in inner)


def test_o2_float16_without_masters_refuses_an_eps_its_float16_state_cannot_hold():
    """Like O3: O2 with master_weights=False keeps AdamW's moments in float16, where the
    default eps=1e-8 rounds to zero and the weights blow up."""
    model = mlp("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"eps=1e-08.*O2 with master_weights=False"):
        amp.initialize(model, opt, "O2", torch.float16, master_weights=False)
    assert all(p.dtype == F32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
