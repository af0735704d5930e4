"""The step-cost model on a GPU: its launch and byte estimates beside the profiler's kernels.

::

    python -m benchmarks.gpu_step_cost --out DIR            # on a CUDA machine, GPU shapes
    python -m benchmarks.gpu_step_cost --out DIR --device cpu --small   # the script's own test

:mod:`benchmarks.step_cost` prices every aten op of a training step as CUDA would run
it (launches, bytes moved) from a run on any device. Here each recipe is built on the
device, warmed up, and then:

1. one step is counted by :class:`benchmarks.step_cost.StepCounter` (the estimate, from
   the op sequence this device dispatches, with the ``multi_tensor_apply`` limits of the
   CUDA version torch was built with);
2. one whole step runs under ``torch.profiler`` and another step's optimizer phase
   (``step()``, the scaler's ``update()``, ``zero_grad()``) alone: the GPU activities
   are counted (kernels, and memory copies and sets apart) and their device time summed.

The optimizer phase is the one the model prices in full (no matrix products), so its
bytes over its kernel time give the bandwidth it reached, shown beside a plain
device-to-device copy's (bytes read plus written). The CPU count committed in
``results/step_cost_gpu_shapes.json``, where present, is shown beside the GPU's own.
On a CPU the estimate runs and the measured columns are ``None``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import environment, jsonable, recorded_command
from benchmarks.gpu_measure import free_memory, one_line, timed_calls
from benchmarks.step_cost import VARIANTS, Workload, count_step, prepare, transformer_workload

__all__ = ["DEFAULT_LABELS", "copy_bandwidth", "main", "measure", "profile_gpu"]

DEFAULT_LABELS = (
    "autocast bf16", "O1 bf16", "O2 bf16", "O3 bf16", "lean bf16", "lean stochastic bf16",
    "autocast+GradScaler fp16", "autocast+mixprec.GradScaler fp16", "O2 fp16",
)  # fmt: skip
CPU_COUNTS = os.path.join(os.path.dirname(__file__), "results", "step_cost_gpu_shapes.json")


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def profile_gpu(fn: Callable[[], Any], device: str) -> dict[str, Any] | None:
    """GPU activities of one call of ``fn``: kernels, copies, sets, device ms; None on a CPU."""
    if torch.device(device).type != "cuda":
        fn()
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # Device-side events, less the user annotations (``Optimizer.step#AdamW.step``): those
    # span the kernels of their range on the GPU timeline and would count them twice.
    gpu = [
        e for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("Optimizer.")
    ]  # fmt: skip
    copies = [e for e in gpu if e.name.startswith("Memcpy")]
    sets = [e for e in gpu if e.name.startswith("Memset")]
    kernels = [e for e in gpu if e not in copies and e not in sets]
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(e.name[:120], []).append(e.time_range.elapsed_us() / 1e3)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:30]
    return {
        "top": [{"name": name, "calls": len(ms), "ms": sum(ms)} for name, ms in top],
        "kernels": len(kernels),
        "memcpy": len(copies),
        "memset": len(sets),
        "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3,
        "all_ms": sum(e.time_range.elapsed_us() for e in gpu) / 1e3,
    }


def copy_bandwidth(device: str, nbytes: int = 2**30) -> float | None:
    """Bytes per second of a device-to-device copy (read plus written); None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.empty(nbytes // 4, device=device).normal_()
    b = torch.empty_like(a)
    times = timed_calls(lambda: b.copy_(a), device, 3, 20)
    return 2 * nbytes / statistics.median(times)


def phase_times(prepared: Any, x: torch.Tensor, y: torch.Tensor, device: str,
                repeats: int = 10) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per phase, medians over ``repeats`` steps: the host's ms to issue it and the ms until
    the device has run it too, each phase started on an idle device.

    A phase whose host time is close to its total keeps the device waiting on the host
    (launch-bound); one whose total is far above its host time keeps the device busy.
    """
    sync = (lambda: torch.cuda.synchronize()) if torch.device(device).type == "cuda" else (
        lambda: None)  # fmt: skip
    samples: dict[str, list[tuple[float, float]]] = {p: [] for p in ("forward", "backward",
                                                                      "optimizer")}  # fmt: skip
    holder: dict[str, Any] = {}  # the loss, from the forward to the backward
    calls = {
        "forward": lambda: holder.__setitem__("loss", prepared.forward(x, y)),
        "backward": lambda: prepared.backward(holder.pop("loss")),
        "optimizer": prepared.step,
    }
    for _ in range(repeats):
        for phase, call in calls.items():
            sync()
            start = time.perf_counter()
            call()
            issued = time.perf_counter()
            sync()
            samples[phase].append(((issued - start) * 1e3, (time.perf_counter() - start) * 1e3))
    return {
        phase: {"host_ms": statistics.median(h for h, _ in pairs),
                "total_ms": statistics.median(t for _, t in pairs)}
        for phase, pairs in samples.items()
    }  # fmt: skip


def measure(label: str, workload: Workload, device: str, limits: str,
            warmup: int = 3) -> dict[str, Any]:  # fmt: skip
    """Estimate and profile recipe ``label`` (a :data:`benchmarks.step_cost.VARIANTS` label)."""
    variant = next(v for v in VARIANTS if v.label == label)
    x, y = workload.x.to(device), workload.y.to(device)
    prepared = prepare(variant, workload.factory, x)
    for _ in range(warmup):
        prepared.train_step(x, y)
    _sync(device)
    counted = count_step(prepared, x, y, warmup=0, limits=limits)
    whole = profile_gpu(lambda: prepared.train_step(x, y), device)
    prepared.backward(prepared.forward(x, y))
    _sync(device)
    optimizer = profile_gpu(prepared.step, device)
    timeline = phase_times(prepared, x, y, device)
    phases = counted["phases"]
    row = {
        "label": label,
        "predicted": {
            "step_launches": counted["total"]["launches"],
            "optimizer_launches": phases["optimizer"]["launches"],
            "optimizer_bytes": phases["optimizer"]["bytes"],
            "optimizer_top": phases["optimizer"]["top_launches"],
        },
        "measured": {"step": whole, "optimizer": optimizer},
        "phase_times": timeline,
    }
    return row


def _cpu_counts() -> dict[str, Any]:
    """The committed CPU count at GPU shapes: optimizer launches and bytes per label."""
    try:
        with open(CPU_COUNTS, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    rows = doc["counts"]["transformer"]["rows"]
    return {
        "limits": doc.get("limits"),
        "rows": {
            label: {k: row["phases"]["optimizer"][k] for k in ("launches", "bytes")}
            for label, row in rows.items()
            if "phases" in row
        },
    }


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def render(doc: dict[str, Any]) -> str:
    """The Markdown table: estimate and measurement side by side, one row per recipe."""
    bandwidth = doc["copy_bandwidth"]
    lines = [
        "| recipe | step launches est. | step kernels (+copies, sets) | optimizer launches est. "
        "| optimizer kernels (+copies, sets) | est./measured | optimizer bytes est. "
        "| optimizer GPU ms | GB/s reached | of copy bandwidth |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in doc["rows"]:
        if "error" in row:
            lines.append(f"| {row['label']} | failed: {row['error']} |" + " |" * 8)
            continue
        p, step, opt = row["predicted"], row["measured"]["step"], row["measured"]["optimizer"]

        def seen(m: dict[str, Any] | None) -> str:
            return "-" if m is None else f"{m['kernels']} (+{m['memcpy']}, {m['memset']})"

        measured_opt = None if opt is None else opt["kernels"] + opt["memcpy"] + opt["memset"]
        rate = None if opt is None else p["optimizer_bytes"] / (opt["all_ms"] / 1e3)
        lines.append(
            f"| {row['label']} | {p['step_launches']:,} | {seen(step)} | "
            f"{p['optimizer_launches']} | {seen(opt)} | "
            f"{_ratio(p['optimizer_launches'], measured_opt)} | "
            f"{p['optimizer_bytes'] / 1e9:.2f} GB | "
            + ("-" if opt is None else f"{opt['all_ms']:.2f}")
            + " | "
            + ("-" if rate is None else f"{rate / 1e9:,.0f}")
            + f" | {_ratio(rate, bandwidth)} |"
        )
    lines += [
        "",
        f"Each phase started on an idle device, batch {doc['batch']} (medians of 10 steps): "
        "ms for the host to issue it / ms until the device has run it.",
        "",
        "| recipe | forward | backward | optimizer |",
        "|---|--:|--:|--:|",
    ]
    for row in doc["rows"]:
        if "phase_times" in row:
            cells = [f"{t['host_ms']:.2f} / {t['total_ms']:.2f}" for t in row["phase_times"].values()]
            lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_step_cost",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--out", required=True, help="folder for gpu_step_cost.json and .md")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--small", action="store_true", help="the small transformer")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--only", help="comma-separated labels (default: DEFAULT_LABELS)")
    parser.add_argument("--cuda13", action="store_true",
                        help="price foreach launches with the larger CUDA 13 limits")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    labels = [v.label for v in VARIANTS]
    args.labels = DEFAULT_LABELS if args.only is None else tuple(args.only.split(","))
    unknown = [label for label in args.labels if label not in labels]
    if unknown:
        parser.error(f"--only: unknown labels {unknown}; choose from {', '.join(labels)}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.makedirs(args.out, exist_ok=True)
    # torch 2.11's CUDA 13 build was measured with the CUDA 12 limits (fused AdamW over
    # 152M parameters: 8 launches, as cuda12 predicts, not cuda13's 2): the default.
    limits = "cuda13" if args.cuda13 else "cuda12"
    workload = transformer_workload(not args.small, args.batch)
    doc: dict[str, Any] = {
        "command": recorded_command("benchmarks.gpu_step_cost",
                                    sys.argv[1:] if argv is None else list(argv)),
        "environment": environment(),
        "device": args.device,
        "workload": workload.name,
        "batch": args.batch,
        "limits": limits,
        "copy_bandwidth": copy_bandwidth(args.device),
        "cpu_counts": _cpu_counts(),
        "rows": [],
    }
    for label in args.labels:
        print(f"  {label} ...", file=sys.stderr, flush=True)
        free_memory(args.device)
        try:
            doc["rows"].append(measure(label, workload, args.device, limits))
        except Exception as err:  # a recipe that fails is a row, the rest still run
            doc["rows"].append({"label": label, "error": one_line(err)})
        free_memory(args.device)  # the recipe is gone with measure()'s frame
    markdown = render(doc)
    with open(os.path.join(args.out, "gpu_step_cost.json"), "w", encoding="utf-8") as f:
        json.dump(jsonable(doc), f, indent=1)
    with open(os.path.join(args.out, "gpu_step_cost.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
