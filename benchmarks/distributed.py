"""Workload 8: what agreeing across ranks costs: 2-process DDP, found-inf all-reduce on vs off.

Two ranks (processes on ``127.0.0.1``, gloo) train the overhead workload's MLP under
``DistributedDataParallel``, one intra-op thread each. Each rank holds two copies of
the model, stepped in one interleaved loop (the same order on both ranks, so their
collectives pair up): ``agree`` (``LossScaleOptimizer``'s default: the found-inf flag
all-reduced with MAX over the ranks before the step) and ``local``
(``process_group="local"``: no all-reduce). Rows: ``AdamW`` (foreach) and
``AdamW(fused=True)`` (the flag stays on the device).

Two phases per row. The whole training step (forward, scaled backward, where DDP
all-reduces the gradients, optimizer step): its medians and the paired ratio
``agree / local``, whose spread (the gradient all-reduce's own jitter) is wider than
the effect. And the optimizer step alone (the backward untimed before it), where the
flag's all-reduce sits: the median over rounds of ``agree - local`` is the time it
adds, and that over the median training step is the share it adds (the target: at
most 2 %). This is an upper bound: besides the all-reduce's latency it holds the wait
for the slower rank, which in a whole step would otherwise fall on DDP's next gradient
all-reduce. The 4-byte all-reduce alone (median of back-to-back calls) is given beside.

GPUs: one rank per GPU with NCCL needs two GPUs; with fewer the GPU row is skipped
and says why. Run alone: ``python -m benchmarks.distributed --preset quick``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._common import (
    PRESETS,
    Case,
    Preset,
    interleaved,
    paired_quartiles,
    paired_ratio,
    summarize,
    workload_main,
)
from benchmarks.overhead import build_models
from mixprec.loss_scale import DynamicLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.tools._spawn import run_on_ranks

__all__ = ["run", "render", "targets"]

TARGET = 0.02  # the share of the training step that the all-reduce may add
RANKS = 2
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
}


def _trainer(model_factory, batch, optimizer: str, process_group, device: str):
    """``(backward, step)``: the scaled forward and backward, and the optimizer step."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model_factory().to(device))
    opt = LossScaleOptimizer(
        OPTIMIZERS[optimizer](ddp.parameters()),
        DynamicLossScale(initial_scale=2.0**15),
        process_group=process_group,
    )
    x, y = (t.to(device) for t in batch)

    def backward() -> None:
        opt.scale_loss(F.mse_loss(ddp(x).float(), y)).backward()  # DDP all-reduces here

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return backward, step


def _allreduce_seconds(device: str, calls: int = 200) -> float:
    flag = torch.zeros((), device=device)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _row(name: str, optimizer: str, trainers: dict, preset: Preset, device: str) -> dict:
    warmup, repeats = preset.overhead_warmup + 2, 3 * preset.overhead_repeats
    whole = [Case(k, lambda b=b, s=s: (b(), s())) for k, (b, s) in trainers.items()]
    full = interleaved(whole, warmup, repeats, device=device)
    step_only = [Case(k, s, prepare=b) for k, (b, s) in trainers.items()]
    alone = interleaved(step_only, warmup, 3 * repeats, device=device)
    added = statistics.median(a - b for a, b in zip(alone["agree"], alone["local"]))
    q1, q3 = paired_quartiles(full["agree"], full["local"])
    return {
        "model": name,
        "optimizer": optimizer,
        "agree": summarize(full["agree"]),
        "local": summarize(full["local"]),
        "ratio": paired_ratio(full["agree"], full["local"]),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "step_agree": summarize(alone["agree"]),
        "step_local": summarize(alone["local"]),
        "added_s": added,
        "added_share": added / statistics.median(full["local"]),
    }


def _rank(rank: int, preset_name: str, device: str) -> dict[str, Any]:
    preset = PRESETS[preset_name]
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    (name, (model_factory, batch_factory)), *_ = build_models(preset).items()
    rows = []
    for optimizer in OPTIMIZERS:
        trainers = {
            label: _trainer(model_factory, batch_factory(), optimizer, group, device)
            for label, group in (("agree", None), ("local", "local"))
        }
        rows.append(_row(name, optimizer, trainers, preset, device))
    return {"rows": rows, "allreduce_s": _allreduce_seconds(device)}


def run(preset: Preset, device: str) -> dict[str, Any]:
    """Time both ranks; return their rows side by side."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.device_count() < RANKS:
        return {
            "ranks": [],
            "note": f"needs {RANKS} GPUs (one per rank, NCCL); this machine has "
            f"{torch.cuda.device_count()}",
        }
    backend = "nccl" if kind == "cuda" else "gloo"
    ranks = run_on_ranks(_rank, preset.name, kind, world_size=RANKS, backend=backend, timeout=1800)
    return {"ranks": ranks, "backend": backend, "target": TARGET}


def targets(device: str, section: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The 2 % target per row, on the rank where the all-reduce added more."""
    checks = []
    if not section or "error" in section or not section.get("ranks"):
        return checks
    for i, row in enumerate(section["ranks"][0]["rows"]):
        share = max(r["rows"][i]["added_share"] for r in section["ranks"])
        checks.append(
            {
                "device": device,
                "workload": "distributed",
                "what": f"{row['model']} {row['optimizer']} DDP x{len(section['ranks'])}: "
                "share of the training step the found-inf all-reduce adds",
                "value": round(share, 4),
                "target": f"<= {TARGET}",
                "met": share <= TARGET,
            }
        )
    return checks


def _ms(stats: dict[str, float]) -> str:
    return f"{1e3 * stats['median_s']:.2f}"


def render(section: dict[str, Any]) -> list[str]:
    """Markdown lines: one table row per rank and optimizer."""
    if not section.get("ranks"):
        return [f"Skipped: {section.get('note', 'no ranks')}.", ""]
    lines = [
        "| rank | model | optimizer | step ms: agree / local | paired ratio (quartiles) "
        "| optimizer step ms: agree / local | added ms | added share | all-reduce alone µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, result in enumerate(section["ranks"]):
        for row in result["rows"]:
            lines.append(
                f"| {rank} | {row['model']} | {row['optimizer']} "
                f"| {_ms(row['agree'])} / {_ms(row['local'])} "
                f"| {row['ratio']:.3f} ({row['ratio_q1']:.3f}-{row['ratio_q3']:.3f}) "
                f"| {_ms(row['step_agree'])} / {_ms(row['step_local'])} "
                f"| {1e3 * row['added_s']:.3f} | {100 * row['added_share']:.2f} % "
                f"| {1e6 * result['allreduce_s']:.0f} |"
            )
    return [*lines, ""]


if __name__ == "__main__":
    workload_main(__doc__, run)
