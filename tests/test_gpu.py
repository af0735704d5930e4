"""CUDA checks: zero host syncs with fused optimizers, float16 O2, bfloat16 O3 and the rewrite.

Skipped without a CUDA device (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from mixprec import LossScaleOptimizer, amp
from mixprec.kernels import compiled as compiled_steps
from mixprec.loss_scale import DynamicLossScale
from mixprec.optim import AdamW8bit
from mixprec.rewrite import rewrite

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    ).cuda()


@pytest.mark.parametrize("master_weights", [False, True])
def test_fused_step_never_syncs_on_cuda(master_weights):
    model = _mlp()
    if master_weights:
        model.half()
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        loss_scale=DynamicLossScale(initial_scale=2.0**15, growth_interval=3),
        master_weights=master_weights,
    )
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    for i in range(6):
        loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)
        opt.scale_loss(loss).backward()
        if i == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        # The first step creates the optimizer state and reads the overflow flag once
        # (a skipped first step must leave no state behind); later steps never sync.
        torch.cuda.set_sync_debug_mode("error" if i > 0 else "default")
        try:
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert int(opt.skipped_steps) == 1 and int(opt.iterations) == 5
    assert opt.loss_scale.device.type == "cuda"


def test_o2_float16_trains_on_cuda():
    model = _mlp()
    model, opt = amp.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), "O2", torch.float16
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 64, device="cuda", generator=g)
    y = (x[:, 0] > 0).long()
    first = None
    for _ in range(50):
        loss = F.cross_entropy(model(x), y)
        first = float(loss) if first is None else first
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    assert float(loss) < 0.5 * first
    assert model[0].weight.dtype == torch.float16 and opt.master_weights


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
def test_o2_batchnorm_takes_low_input_on_cuda(low, channels_last):
    """cuDNN's (or the native) BatchNorm computes in float32 from a low input with float32
    weights: O2 passes the input through, and trains as the cast-through path did."""
    from amp_internals import batchnorm_low_input

    def run(pass_through):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 4),
        ).cuda()
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        net = net.to(memory_format=fmt)
        model, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", low)
        x = torch.randn(32, 3, 16, 16, device="cuda").to(memory_format=fmt)
        y = torch.arange(32, device="cuda") % 4
        with batchnorm_low_input(pass_through):
            for _ in range(5):
                loss = F.cross_entropy(model(x), y)
                opt.scale_loss(loss).backward()
                opt.step()
                opt.zero_grad()
        return loss.item(), model[1].running_var.clone()

    loss, running_var = run(True)
    ref_loss, ref_running_var = run(False)
    assert math.isfinite(loss) and abs(loss - ref_loss) < 1e-2 * abs(ref_loss) + 1e-3
    torch.testing.assert_close(running_var, ref_running_var, rtol=1e-2, atol=1e-3)


def test_rewrite_runs_allow_ops_in_float16_on_cuda():
    model = _mlp()
    gm = rewrite(model, (torch.randn(8, 64, device="cuda"),), dtype=torch.float16)
    x = torch.randn(16, 64, device="cuda")
    out = gm(x)
    assert out.dtype == torch.float32 and out.device.type == "cuda"
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)


def test_o3_bfloat16_unscales_bfloat16_gradients_on_cuda():
    """CUDA's fused unscale kernel has no bfloat16 version: the foreach fallback runs."""
    model = _mlp()
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "O3", torch.bfloat16
    )
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    before = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(F.cross_entropy(model(x).float(), y)).backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    opt.step()
    opt.zero_grad()
    assert bool(opt.last_step_skipped)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.scale_loss(F.cross_entropy(model(x).float(), y)).backward()
    opt.step()
    assert model[0].weight.dtype == torch.bfloat16 and int(opt.iterations) == 1


def _fused_or_eager(mode: str, fused: bool | None):
    """A bfloat16 MLP with ``mode``'s masters and ``AdamW(fused=True)``; ``fused=None``
    leaves the choice to the default (the compiled step on a GPU)."""
    model = _mlp().bfloat16()
    if mode == "split8-8bit":  # split8 masters around AdamW8bit (its default: fused=None)
        inner: torch.optim.Optimizer = AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt = LossScaleOptimizer(inner, loss_scale=None, master_weights=mode.removesuffix("-8bit"))
    if fused is not None:
        opt._master.fused = fused
    return model, opt


@pytest.mark.parametrize("mode", ["kahan", "stochastic", "split8", "fp32", "split8-8bit"])
def test_the_compiled_master_steps_are_priced_right_on_cuda(mode):
    """What the step-cost benchmark assumes of the compiled steps (``fused_lean_cost``),
    seen in inductor's CUDA code: no buffer of a parameter's size (the 8-bit step's block
    scales only), so the step's peak is the state at rest and the gradients, and the
    parameters' loops in one launch per 16 (its combo kernels)."""
    from test_fused_lean import FORMAT, step_arguments
    from torch._inductor.utils import run_and_get_code

    shapes = ((256, 256), 1000)  # a 2-D weight; a partial last 8-bit block
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(
            compiled_steps.compile_math(FORMAT[mode]), FORMAT[mode], *step_arguments(mode, shapes, "cuda"))
    code = "\n".join(codes)
    buffers = re.findall(r"empty_strided_cuda\(\(([^)]*)\)", code)
    allocated = [math.prod(int(d) for d in shape.split(",") if d.strip()) for shape in buffers]
    assert all(numel <= (1 << 16) // 256 for numel in allocated), buffers
    launches = re.findall(r"^\s+(\w+)\.run\(", code, re.MULTILINE)
    assert len(launches) == -(-len(shapes) // compiled_steps.COMBO_NODES), launches


@pytest.mark.parametrize("mode", ["kahan", "stochastic", "split8", "fp32", "split8-8bit"])
def test_the_compiled_master_steps_are_the_default_and_never_sync_on_cuda(mode):
    """With AdamW(fused=True) on a GPU the compiled step is taken (one elementwise
    function per step); it trains as the eager step does and, after the first step
    (which creates the state and reads the skip once), never waits for the GPU."""
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    runs = []
    for fused in (None, False):
        model, opt = _fused_or_eager(mode, fused)
        for i in range(6):
            loss = F.cross_entropy(model(x.bfloat16()).float(), y)
            opt.scale_loss(loss).backward()
            if fused is None and mode in ("split8", "fp32", "split8-8bit"):
                assert opt._fuses(None)
            elif fused is None:
                assert opt._master._fuses(None)
            torch.cuda.set_sync_debug_mode("error" if i > 0 and fused is None else "default")
            try:
                opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        runs.append(model)
    # (stochastic rounding of weights or codes: another random stream, a few bfloat16
    # ulps apart)
    atol = 2e-2 if mode in ("stochastic", "split8-8bit") else 1e-4
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.allclose(p.float(), q.float(), rtol=2**-6, atol=atol)
