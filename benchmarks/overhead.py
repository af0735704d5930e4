"""Workload 1: the cost of loss scaling, ``LossScaleOptimizer`` against ``torch.amp.GradScaler``.

Two models bracket the cost:

* ``mlp-10m``: an MLP with about 10.5M parameters in 8 tensors, where the
  optimizer's memory traffic dominates and per-tensor overhead is invisible;
* ``many-small``: 250 residual ``Linear(32, 32)`` layers, 500 parameter tensors
  and about 0.26M parameters, where the per-tensor and per-op Python overhead
  dominates.

For each model and inner optimizer three copies (same initial weights) are
stepped in one interleaved loop: ``gradscaler`` (``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()``), ``mixprec`` (``opt.scale_loss(loss).backward();
opt.step()``) and ``bare`` (the inner optimizer with no loss scaling, the floor).
Two phases: the whole training step (forward + backward + optimizer step), and the
optimizer step alone, where the gradients are refilled with the same scaled values
before each (untimed) step so that both wrappers unscale, check and apply exactly
the same numbers. Both scalers start at ``2**15`` and grow every 2000 steps.

A third phase times the wrappers alone, around an inner optimizer whose ``step``
does nothing (plain, and advertising the fused kernels' ``found_inf`` API), on
the two models and on a tiny one (2 tensors) that shows the fixed cost per step.
Where mixprec is slower there, the step is profiled: ``cProfile`` for the
Python-level own time per function, and a dispatch-mode counter for the ATen
ops per step.

Forward passes run in float32 on the CPU (the loss-scaling path does not depend on
the forward precision there) and under ``torch.autocast(float16)`` on a GPU, where
loss scaling is the real recipe.

Run one model alone: ``python -m benchmarks.overhead --preset quick``.
"""

from __future__ import annotations

import collections
import copy
import cProfile
import json
import pstats
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._common import (
    PRESETS,
    Case,
    Preset,
    interleaved,
    paired_quartiles,
    paired_ratio,
    summarize,
    workload_parser,
)
from mixprec.loss_scale import DynamicLossScale
from mixprec.optim import GradScaler, LossScaleOptimizer
from mixprec.train.models import MLP

__all__ = [
    "ManySmall",
    "NoOpOptimizer",
    "ScalingTrainer",
    "build_models",
    "optimizer_factories",
    "profile_step",
    "run",
]

MLP_IN_FEATURES = 1024
INIT_SCALE = 2.0**15


class ManySmall(nn.Module):
    """``layers`` residual blocks ``h = h + 0.1 * tanh(Linear(h))``: two tensors per block.

    The residual form keeps activations and gradients at a steady size at any
    depth (a plain stack of small layers would drive them into denormals, which
    are slow on CPUs and would distort the timings).
    """

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = h + 0.1 * torch.tanh(block(h))
        return h


def build_models(preset: Preset) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    """Name -> (model factory, batch factory) for the two overhead models."""

    def mlp() -> nn.Module:
        width = preset.mlp_width
        return MLP(in_features=MLP_IN_FEATURES, hidden=(width, width, width), num_classes=10)

    def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(preset.mlp_batch, MLP_IN_FEATURES, generator=g)
        return x, torch.randn(preset.mlp_batch, 10, generator=g)

    def small() -> nn.Module:
        return ManySmall(preset.small_layers, preset.small_width)

    def small_batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, preset.small_width, generator=g)
        return x, torch.randn(32, preset.small_width, generator=g)

    mlp_name = "mlp-10m" if preset.mlp_width == 2048 else f"mlp-w{preset.mlp_width}"
    small_name = f"many-small-{2 * preset.small_layers}"
    return {mlp_name: (mlp, mlp_batch), small_name: (small, small_batch)}


def _fused_supported(device: str) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return torch.device(device).type in _get_fused_kernels_supported_devices()


def optimizer_factories(device: str) -> dict[str, Callable[[Any], torch.optim.Optimizer]]:
    """The inner optimizers: SGD (default implementation), Adam foreach, and the fused kernels.

    Fused SGD/Adam are included wherever the device has the kernels (CUDA, and the
    CPU since torch 2.4).
    """
    factories: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    }
    if _fused_supported(device):
        factories["sgd-fused"] = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True)
        factories["adam-fused"] = lambda p: torch.optim.Adam(p, lr=1e-3, fused=True)
    return factories


class ScalingTrainer:
    """One model copy with one loss-scaling variant: ``gradscaler`` (torch's),
    ``mixprec`` (``LossScaleOptimizer``), ``mixprec_scaler`` (``mixprec.GradScaler``) or
    ``bare``."""

    def __init__(
        self,
        variant: str,
        model: nn.Module,
        factory: Callable[[Any], torch.optim.Optimizer],
        batch: tuple[torch.Tensor, torch.Tensor],
        device: str,
    ) -> None:
        self.variant = variant
        self.model = model
        self.device = device
        self.x, self.target = batch
        self.params = [p for p in model.parameters()]
        inner = factory(self.params)
        self.scaler = None
        if variant in ("gradscaler", "mixprec_scaler"):
            scaler_class = torch.amp.GradScaler if variant == "gradscaler" else GradScaler
            self.scaler = scaler_class(torch.device(device).type, init_scale=INIT_SCALE)
            self.opt: torch.optim.Optimizer = inner
        elif variant == "mixprec":
            self.opt = LossScaleOptimizer(inner, DynamicLossScale(initial_scale=INIT_SCALE))
        else:
            self.opt = inner
        self.saved_grads: list[torch.Tensor] = []

    def loss(self) -> torch.Tensor:
        # Autocast float16 on a GPU (where loss scaling is needed); float32 on the CPU.
        on_gpu = torch.device(self.device).type == "cuda"
        with torch.autocast(self.device, dtype=torch.float16, enabled=on_gpu):
            out = self.model(self.x)
        return F.mse_loss(out.float(), self.target)

    def backward(self) -> None:
        loss = self.loss()
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif self.variant == "mixprec":
            self.opt.scale_loss(loss).backward()  # type: ignore[attr-defined]
        else:
            loss.backward()

    def opt_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()

    def full_step(self) -> None:
        self.backward()
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)

    def save_grads(self, scaled_grads: list[torch.Tensor]) -> None:
        """Keep the gradients to refill before every optimizer-step-only round."""
        if self.variant == "bare":
            self.saved_grads = [g / INIT_SCALE for g in scaled_grads]
        else:
            self.saved_grads = [g.clone() for g in scaled_grads]
        for p, g in zip(self.params, self.saved_grads):
            p.grad = g.clone()
        if self.scaler is not None:
            # GradScaler creates its scale on the first scale() call; without a
            # backward pass in this phase, make that call here.
            self.scaler.scale(torch.zeros((), device=self.device))

    def refill_grads(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.grad for p in self.params], self.saved_grads)
        # These gradients stand for a scaled loss's: say so, as scale() would.
        if self.variant == "mixprec":
            self.opt.loss_scaler.mark_scaled()  # type: ignore[attr-defined]
        elif self.variant == "mixprec_scaler":
            self.scaler.loss_scale.mark_scaled()  # type: ignore[union-attr]


def _scaled_grads(model: nn.Module, batch: tuple, device: str) -> list[torch.Tensor]:
    probe = ScalingTrainer(
        "gradscaler", copy.deepcopy(model), lambda p: torch.optim.SGD(p, lr=0.0), batch, device
    )
    probe.backward()
    return [p.grad.detach().clone() for p in probe.params]


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops that reach the backend (a fused foreach op counts once)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _short_location(filename: str, line: int, func: str) -> str:
    path = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = path.rsplit("/", 1)[-1]
    return f"{path}:{line}({func})" if line else func


def profile_step(trainer: ScalingTrainer, steps: int) -> dict[str, Any]:
    """Where one optimizer step's time goes: Python functions (cProfile) and ATen ops.

    Each of ``steps`` steps is profiled on its own with ``cProfile`` (the gradients
    are refilled outside the profiled region); a function's own time (``self_us``)
    and cumulative time (``cum_us``) are medians over the steps, so one step that
    the scheduler interrupted does not move them. A ``TorchDispatchMode`` counts
    the ATen ops dispatched per step: on a CPU each costs a few microseconds of
    dispatch however small its tensors, on a GPU each is a kernel launch.
    """
    per_step: list[dict[str, tuple[float, float, float]]] = []
    totals = []
    for _ in range(steps):
        trainer.refill_grads()
        prof = cProfile.Profile()
        prof.enable()
        trainer.opt_step()
        prof.disable()
        raw = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        step: dict[str, tuple[float, float, float]] = {}
        for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in raw.items():
            if func == "<method 'disable' of '_lsprof.Profiler' objects>":
                continue
            step[_short_location(filename, line, func)] = (ncalls, tottime, cumtime)
        per_step.append(step)
        totals.append(sum(v[1] for v in step.values()))
    rows = []
    for name in set().union(*per_step):
        entries = [step.get(name, (0, 0.0, 0.0)) for step in per_step]
        rows.append(
            {
                "function": name,
                "calls": statistics.median(e[0] for e in entries),
                "self_us": 1e6 * statistics.median(e[1] for e in entries),
                "cum_us": 1e6 * statistics.median(e[2] for e in entries),
            }
        )
    rows.sort(key=lambda r: r["self_us"], reverse=True)
    trainer.refill_grads()
    with _OpCounter() as ops:
        trainer.opt_step()
    return {
        "steps": steps,
        "python_total_us": 1e6 * statistics.median(totals),
        "top_functions": rows[:12],
        "aten_ops": sum(ops.counts.values()),
        "top_ops": [{"op": k, "calls": v} for k, v in ops.counts.most_common(10)],
    }


def run_model(
    model_name: str,
    model_factory: Callable[[], nn.Module],
    batch_factory: Callable[[], tuple],
    preset: Preset,
    device: str,
) -> list[dict[str, Any]]:
    """Full step and optimizer step of the three variants, for every inner optimizer."""
    rows = []
    for opt_name, factory in optimizer_factories(device).items():
        torch.manual_seed(0)
        base = model_factory().to(device)
        batch = tuple(t.to(device) for t in batch_factory())
        trainers = {
            v: ScalingTrainer(v, copy.deepcopy(base), factory, batch, device)
            for v in ("gradscaler", "mixprec", "mixprec_scaler", "bare")
        }
        row: dict[str, Any] = {
            "model": model_name,
            "optimizer": opt_name,
            "params": sum(p.numel() for p in base.parameters()),
            "tensors": sum(1 for _ in base.parameters()),
            "device": device,
        }
        # Phase 1: the whole step.
        cases = [Case(name, t.full_step) for name, t in trainers.items()]
        times = interleaved(cases, preset.overhead_warmup, preset.overhead_repeats, device)
        row["full_step"] = _phase_summary(times)
        # Phase 2: the optimizer step alone, on identical refilled gradients.
        grads = _scaled_grads(base, batch, device)
        for t in trainers.values():
            t.save_grads(grads)
        cases = [Case(name, t.opt_step, t.refill_grads) for name, t in trainers.items()]
        times = interleaved(cases, preset.overhead_warmup, preset.step_only_repeats, device)
        row["step_only"] = _phase_summary(times)
        rows.append(row)
    return rows


class NoOpOptimizer(torch.optim.Optimizer):
    """An inner optimizer whose ``step`` does nothing, to time a loss-scaling wrapper alone.

    ``fused_api=True`` advertises ``_step_supports_amp_scaling`` like the fused
    kernels, so both wrappers take their fused path (hand over ``found_inf``, no
    host sync) instead of reading the flag to decide whether to step.
    """

    def __init__(self, params: Any, fused_api: bool = False) -> None:
        super().__init__(params, {"lr": 0.0})
        if fused_api:
            self._step_supports_amp_scaling = True

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        return None


def run_wrapper_only(preset: Preset, device: str, profile: bool) -> list[dict[str, Any]]:
    """The wrappers' own cost: ``opt.step()`` vs ``scaler.step(opt); scaler.update()`` on a no-op.

    What remains is unscaling and checking the gradients (one fused kernel per
    dtype in both), the scale update, and the Python and small-op bookkeeping
    around them; a tiny model (2 tensors) shows the fixed cost per step.
    """
    models = dict(build_models(preset))
    models["tiny-2"] = (
        lambda: nn.Linear(8, 8),
        lambda: (torch.randn(4, 8), torch.randn(4, 8)),
    )
    rows = []
    for model_name, (model_factory, batch_factory) in models.items():
        for inner_name, fused_api in (("no-op", False), ("no-op, fused API", True)):
            torch.manual_seed(0)
            base = model_factory().to(device)
            batch = tuple(t.to(device) for t in batch_factory())

            def factory(params: Any, fused_api: bool = fused_api) -> torch.optim.Optimizer:
                return NoOpOptimizer(params, fused_api)

            trainers = {
                v: ScalingTrainer(v, copy.deepcopy(base), factory, batch, device)
                for v in ("gradscaler", "mixprec", "mixprec_scaler")
            }
            grads = _scaled_grads(base, batch, device)
            for t in trainers.values():
                t.save_grads(grads)
            cases = [Case(name, t.opt_step, t.refill_grads) for name, t in trainers.items()]
            times = interleaved(cases, preset.overhead_warmup, preset.step_only_repeats, device)
            row: dict[str, Any] = {
                "model": model_name,
                "inner": inner_name,
                "tensors": sum(1 for _ in base.parameters()),
                "device": device,
                "wrapper_only": _phase_summary(times),
            }
            if profile and row["wrapper_only"]["ratio"] > 1.0:
                steps = min(max(5, preset.step_only_repeats), 20)
                row["profile"] = {
                    name: profile_step(trainers[name], steps) for name in ("mixprec", "gradscaler")
                }
            rows.append(row)
    return rows


def _phase_summary(times: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: summarize(ts) for name, ts in times.items()}
    out["ratio"] = paired_ratio(times["mixprec"], times["gradscaler"])
    if "mixprec_scaler" in times:  # mixprec.GradScaler, the drop-in, against torch's
        out["scaler_ratio"] = paired_ratio(times["mixprec_scaler"], times["gradscaler"])
    # Quartiles of the per-round ratios: how far noise moves one round.
    out["ratio_q1"], out["ratio_q3"] = paired_quartiles(times["mixprec"], times["gradscaler"])
    out["ratio_of_medians"] = out["mixprec"]["median_s"] / out["gradscaler"]["median_s"]
    out["mixprec_minus_gradscaler_us"] = 1e6 * statistics.median(
        m - g for m, g in zip(times["mixprec"], times["gradscaler"], strict=True)
    )
    if "bare" in times:
        for name in ("mixprec", "mixprec_scaler", "gradscaler"):
            # Paired per-round difference above the bare inner optimizer.
            out[f"{name}_overhead_us"] = 1e6 * statistics.median(
                a - b for a, b in zip(times[name], times["bare"], strict=True)
            )
    return out


def run(preset: Preset, device: str = "cpu", profile: bool = True) -> dict[str, Any]:
    """All models x optimizers, then the wrappers alone; profiles where mixprec is slower."""
    rows = []
    for name, (model_factory, batch_factory) in build_models(preset).items():
        rows.extend(run_model(name, model_factory, batch_factory, preset, device))
    return {
        "target": "mixprec / GradScaler step time <= 1.0",
        "anchor": "torch.amp.GradScaler",
        "rows": rows,
        "wrapper_only": run_wrapper_only(preset, device, profile),
    }


def main(argv: list[str] | None = None) -> None:
    parser = workload_parser(__doc__)
    parser.set_defaults(preset="quick")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv)
    result = run(PRESETS[args.preset], args.device, profile=not args.no_profile)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
