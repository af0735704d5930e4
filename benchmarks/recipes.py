"""The training configurations compared by workloads 3-5, each as one step function.

========================  =====================================================================
recipe                    one training step
========================  =====================================================================
``fp32``                  ``loss = ce(model(x), y); loss.backward(); opt.step()``
``autocast``              ``with torch.autocast(dev, dtype): out = model(x)``; float32 loss;
                          plain backward and step (PyTorch's bfloat16 recipe)
``autocast+gradscaler``   the same with ``torch.amp.GradScaler`` (PyTorch's float16 recipe;
                          for bfloat16 it scales and unscales for nothing, kept as the
                          usual copy-paste recipe)
``autocast+mixprec.       the same with ``mixprec.GradScaler``, the drop-in (in
GradScaler``              :data:`EXTRA_RECIPES`: built here, timed by the GPU benchmark)
``O1``, ``O2``, ``O3``    ``model, opt = mixprec.amp.initialize(model, opt, level, dtype)``;
                          ``opt.scale_loss(loss).backward(); opt.step()``
``O2+fp8``                O2 with ``fp8=True``: linear layers in float8, dynamic scaling
                          (in :data:`EXTRA_RECIPES`: timed by the GPU benchmark)
``O2+fp8-rowwise``        the same with ``fp8="rowwise"``: a scale per row (in
                          :data:`EXTRA_RECIPES`, beside torchao's rowwise recipe)
``lean``                  the lean level: O3 with Kahan-compensated updates (in
                          :data:`EXTRA_RECIPES`: timed by the GPU benchmark)
``rewrite``               ``model = mixprec.rewrite.rewrite(model, (x,), dtype)``;
                          ``opt = mixprec.LossScaleOptimizer(opt, loss_scale)``
========================  =====================================================================

Every recipe starts from the same float32 weights (``torch.manual_seed`` before the
model is built), uses the same inner optimizer (AdamW, fused where the device has
the kernel, so no recipe pays a host sync for skipping steps) and computes the loss
in float32. Loss scaling follows each API's default for the dtype: dynamic for
float16, none for bfloat16 (``rewrite`` is given the same choice explicitly, since
its own default is always dynamic). ``compile_model=True`` runs the prepared model
under ``torch.compile`` (default inductor mode; the optimizer step stays eager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.train.models import LeNet5, TransformerClassifier

__all__ = [
    "EXTRA_RECIPES",
    "RECIPES",
    "Recipe",
    "build_recipe",
    "make_optimizer",
    "workload_model",
]

RECIPES: tuple[str, ...] = ("fp32", "autocast", "autocast+gradscaler", "O1", "O2", "O3", "rewrite")
#: Recipes :func:`build_recipe` also builds, which the CPU workloads do not time.
EXTRA_RECIPES: tuple[str, ...] = ("autocast+mixprec.GradScaler", "O2+fp8", "O2+fp8-rowwise",
                                   "lean")  # fmt: skip

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass
class Recipe:
    """A model and optimizer prepared one way; ``step(x, y)`` trains, ``logits(x)`` evaluates."""

    name: str
    dtype: torch.dtype
    model: nn.Module
    optimizer: Any  # what an LR scheduler drives: the inner optimizer or the wrapper
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]


def make_optimizer(params: Any, device: str, lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW, fused where the device has the kernel."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    fused = torch.device(device).type in _get_fused_kernels_supported_devices()
    return torch.optim.AdamW(params, lr=lr, fused=fused or None)


def workload_model(name: str, dims: dict[str, int] | None = None) -> nn.Module:
    """``"transformer"`` (a TransformerClassifier of ``dims``) or ``"lenet5"`` (8x8 digits)."""
    if name == "transformer":
        return TransformerClassifier(num_classes=10, **(dims or {}))
    if name == "lenet5":
        return LeNet5(num_classes=10, num_channels=1, input_size=8)
    raise ValueError(f"unknown workload model {name!r}; use 'transformer' or 'lenet5'")


def _plain_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    device_type: str,
    autocast_dtype: torch.dtype | None,
    scaler: Any,  # torch.amp.GradScaler, mixprec.GradScaler or None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(
            device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
        ):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _scaled_step(
    model: nn.Module, opt: Any
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _logits(
    model: nn.Module, device_type: str, autocast_dtype: torch.dtype | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def logits(x: torch.Tensor) -> torch.Tensor:
        was_training = model.training
        model.eval()
        try:
            with (
                torch.no_grad(),
                torch.autocast(
                    device_type,
                    dtype=autocast_dtype or torch.float32,
                    enabled=autocast_dtype is not None,
                ),
            ):
                return model(x).float()
        finally:
            model.train(was_training)

    return logits


def build_recipe(
    name: str,
    model_factory: Callable[[], nn.Module],
    example_x: torch.Tensor,
    device: str,
    dtype: torch.dtype,
    lr: float = 1e-3,
    seed: int = 0,
    compile_model: bool = False,
) -> Recipe:
    """Build recipe ``name`` (:data:`RECIPES`, :data:`EXTRA_RECIPES`) in ``dtype`` on ``device``.

    The model comes from ``model_factory()`` after ``torch.manual_seed(seed)``, so
    every recipe starts from the same weights. ``compile_model``: steps and logits
    call ``torch.compile`` of the prepared model (``Recipe.model`` stays the module
    that owns the parameters).
    """
    if name not in RECIPES + EXTRA_RECIPES:
        known = ", ".join(RECIPES + EXTRA_RECIPES)
        raise ValueError(f"unknown recipe {name!r}; choose one of {known}")
    torch.manual_seed(seed)
    model = model_factory().to(device)
    model.train()
    device_type = torch.device(device).type
    inner = make_optimizer(model.parameters(), device, lr)
    if name == "O3" and dtype == torch.float16:
        # O3 keeps AdamW's state in float16, where the default eps=1e-8 underflows;
        # amp.initialize refuses eps below float16's smallest normal (6.1e-5).
        for group in inner.param_groups:
            group["eps"] = 1e-4

    def run(prepared: nn.Module) -> nn.Module:  # what steps and logits call
        return torch.compile(prepared) if compile_model else prepared

    if name == "fp32":
        runner = run(model)
        step = _plain_step(runner, inner, device_type, None, None)
        return Recipe(name, torch.float32, model, inner, step, _logits(runner, device_type, None))
    if name.startswith("autocast"):
        scaler = None
        if name == "autocast+gradscaler":
            scaler = torch.amp.GradScaler(device_type)
        elif name == "autocast+mixprec.GradScaler":
            from mixprec import GradScaler

            scaler = GradScaler(device_type)
        runner = run(model)
        step = _plain_step(runner, inner, device_type, dtype, scaler)
        return Recipe(name, dtype, model, inner, step, _logits(runner, device_type, dtype))
    if name in ("O1", "O2", "O3", "O2+fp8", "O2+fp8-rowwise", "lean"):
        from mixprec import amp

        level, _, fp8 = name.partition("+")
        recipe = {"": False, "fp8": True, "fp8-rowwise": "rowwise"}[fp8]
        model, opt = amp.initialize(model, inner, level=level, dtype=dtype, fp8=recipe)
        runner = run(model)
        step = _scaled_step(runner, opt)
        return Recipe(name, dtype, model, opt, step, _logits(runner, device_type, None))
    from mixprec import LossScaleOptimizer
    from mixprec.rewrite import rewrite

    loss_scale = "dynamic" if dtype == torch.float16 else "none"
    graph = rewrite(model, (example_x,), dtype=dtype)
    opt = LossScaleOptimizer(inner, loss_scale)
    runner = run(graph)
    step = _scaled_step(runner, opt)
    return Recipe(name, dtype, graph, opt, step, _logits(runner, device_type, None))
