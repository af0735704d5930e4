"""Uses of mixprec's public API for mypy to check; never imported or collected by pytest.

``python -m mypy`` checks this file (``[tool.mypy] files`` in pyproject.toml). The
correct uses must type-check. Each wrong use below carries ``# type: ignore[arg-type]``,
and with ``warn_unused_ignores`` mypy fails if a wrong use is *not* rejected: an
option widened back to ``str`` or ``Any`` turns its ignore into an error.
tests/test_typing.py runs mypy on this file.
"""

from __future__ import annotations

import torch

import mixprec
from mixprec import amp
from mixprec.loss_scale import DynamicLossScale, loss_scale_from_spec
from mixprec.optim import LossScaleOptimizer
from mixprec.typing import (
    DTypeName,
    Float8Recipe,
    Level,
    LossScaleSpec,
    LowPrecision,
    MasterWeights,
    ModelLevel,
)

# The aliases annotate user code.
LEVEL: Level = "O2"
MODEL_LEVEL: ModelLevel = "rewrite"
DTYPE_NAME: DTypeName = "half"
LOW: LowPrecision = torch.bfloat16
SPEC: LossScaleSpec = "dynamic"
MASTERS: MasterWeights = "kahan"
RECIPE: Float8Recipe = "dynamic"


def _net_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def correct_uses() -> None:
    net, opt = _net_and_optimizer()
    amp.initialize(net, opt, level="O2", dtype=torch.bfloat16)
    amp.initialize(net, opt, "O1", torch.float16, loss_scale="dynamic")
    amp.initialize(net, opt, level="O3", dtype="bf16", loss_scale=None, master_weights=False)
    amp.initialize(net, opt, level="lean", dtype="bfloat16", master_weights="kahan")
    amp.initialize(net, opt, level="O2", dtype="fp16", loss_scale=1024.0, master_weights=True)
    amp.initialize(net, opt, level="O2", loss_scale=2**16, master_weights="split", fp8="delayed")
    amp.initialize(net, opt, level="auto", loss_scale=DynamicLossScale(), fp8=True)
    amp.initialize(net, level="O0", fp8=None)

    LossScaleOptimizer(opt)
    LossScaleOptimizer(opt, loss_scale="dynamic", master_weights="kahan")
    LossScaleOptimizer(opt, "none", master_weights="stochastic")
    LossScaleOptimizer(opt, None, master_weights="fp32")
    LossScaleOptimizer(opt, 128, master_weights=True)
    LossScaleOptimizer(opt, loss_scale=DynamicLossScale(initial_scale=2.0**10))
    mixprec.LossScaleOptimizer(opt, loss_scale=2.0**15)

    loss_scale_from_spec("dynamic")
    loss_scale_from_spec("none")
    loss_scale_from_spec(None)
    loss_scale_from_spec(512.0)
    mixprec.loss_scale_from_spec(mixprec.StaticLossScale(8.0))
    amp.LEVEL_SPECS["O2"].default_loss_scale(torch.bfloat16)
    amp.LEVEL_SPECS["rewrite"].default_loss_scale(torch.float16)
    amp.LEVEL_SPECS[MODEL_LEVEL].default_loss_scale(torch.float16)
    amp.initialize(net, opt, LEVEL, LOW, loss_scale=SPEC, master_weights=MASTERS, fp8=RECIPE)


def wrong_uses() -> None:
    """Each line must be rejected by mypy (its ignore is then used)."""
    net, opt = _net_and_optimizer()
    amp.initialize(net, opt, level="O7")  # type: ignore[arg-type]
    amp.initialize(net, opt, "O4")  # type: ignore[arg-type]
    amp.initialize(net, opt, level="O2", dtype="fp32")  # type: ignore[arg-type]
    amp.initialize(net, opt, loss_scale="dynamc")  # type: ignore[arg-type]
    amp.initialize(net, opt, level="O2", master_weights="fp64")  # type: ignore[arg-type]
    amp.initialize(net, opt, fp8="static")  # type: ignore[arg-type]

    LossScaleOptimizer(opt, loss_scale="dynamc")  # type: ignore[arg-type]
    LossScaleOptimizer(opt, "static")  # type: ignore[arg-type]
    LossScaleOptimizer(opt, master_weights="fp64")  # type: ignore[arg-type]
    LossScaleOptimizer(opt, master_weights="float32")  # type: ignore[arg-type]
    mixprec.LossScaleOptimizer(opt, loss_scale="Dynamic")  # type: ignore[arg-type]

    loss_scale_from_spec("dynamc")  # type: ignore[arg-type]
    amp.LEVEL_SPECS["O9"].default_loss_scale(torch.float16)  # type: ignore[index]
