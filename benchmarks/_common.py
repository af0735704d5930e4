"""Shared pieces of the benchmark suite: presets, interleaved timing, environment, children.

Timing rule used everywhere: every configuration of a comparison is stepped in the
same loop, one step each per round, and the order is reversed every other round
(A B C, C B A, A B C, ...), so slow drift and other processes' load hit every
configuration alike. A ratio is the median over rounds of the per-round ratio
``time(B) / time(A)``; the per-configuration medians are reported too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "Preset",
    "PRESETS",
    "Case",
    "interleaved",
    "summarize",
    "paired_ratio",
    "paired_quartiles",
    "device_sync",
    "environment",
    "run_child",
    "low_dtypes",
    "load_average",
    "jsonable",
    "recorded_command",
]


@dataclasses.dataclass(frozen=True)
class Preset:
    """How big and how long each workload runs."""

    name: str
    # Workload 1 and 2: loss-scaling overhead and host syncs.
    mlp_width: int  # hidden width of the 3-hidden-layer MLP (2048 gives about 10.5M parameters)
    mlp_batch: int
    small_layers: int  # Linear layers of the many-small-tensors model (2 tensors each)
    small_width: int
    overhead_warmup: int
    overhead_repeats: int  # timed rounds of the full step
    step_only_repeats: int  # timed rounds of the optimizer step alone
    # Workload 3 and 4: training throughput and peak memory.
    transformer: dict[str, int]
    transformer_batch: int
    transformer_batch_gpu: int
    lenet_batch: int
    train_warmup: int
    train_repeats: int  # timed rounds of the transformer
    lenet_repeats: int  # timed rounds of LeNet-5 (milliseconds a step: more rounds are cheap)
    memory_steps: int
    memory_models: tuple[str, ...]  # models whose recipes get a peak-memory child process
    memory_recipes: tuple[str, ...] | None  # None: every recipe
    # Workload 5: accuracy parity.
    accuracy_epochs: int
    accuracy_batch: int
    accuracy_seeds: int  # runs per recipe (seeds 0, 1, ...), averaged
    # Workload 6: matmul rate.
    matmul_size: int
    matmul_size_gpu: int


_TRANSFORMER_FULL = {
    "seq_len": 128,
    "token_dim": 16,
    "d_model": 512,
    "nhead": 8,
    "num_layers": 4,
    "dim_feedforward": 2048,
}

PRESETS: dict[str, Preset] = {
    "full": Preset(
        name="full",
        mlp_width=2048,
        mlp_batch=64,
        small_layers=250,
        small_width=32,
        overhead_warmup=3,
        overhead_repeats=15,
        step_only_repeats=30,
        transformer=_TRANSFORMER_FULL,
        transformer_batch=8,
        transformer_batch_gpu=64,
        lenet_batch=128,
        train_warmup=2,
        train_repeats=9,
        lenet_repeats=40,
        memory_steps=3,
        memory_models=("transformer", "lenet5"),
        memory_recipes=None,
        accuracy_epochs=20,
        accuracy_batch=64,
        accuracy_seeds=3,
        matmul_size=2048,
        matmul_size_gpu=8192,
    ),
    "quick": Preset(
        name="quick",
        mlp_width=512,
        mlp_batch=32,
        small_layers=250,
        small_width=32,
        overhead_warmup=2,
        overhead_repeats=5,
        step_only_repeats=7,
        transformer={**_TRANSFORMER_FULL, "num_layers": 1, "seq_len": 64},
        transformer_batch=4,
        transformer_batch_gpu=32,
        lenet_batch=128,
        train_warmup=1,
        train_repeats=5,
        lenet_repeats=10,
        memory_steps=2,
        memory_models=("transformer",),
        memory_recipes=("fp32", "autocast", "O2", "O3"),
        accuracy_epochs=8,
        accuracy_batch=64,
        accuracy_seeds=1,
        matmul_size=1024,
        matmul_size_gpu=4096,
    ),
    "smoke": Preset(
        name="smoke",
        mlp_width=128,
        mlp_batch=16,
        small_layers=25,
        small_width=16,
        overhead_warmup=1,
        overhead_repeats=5,
        step_only_repeats=5,
        transformer={
            "seq_len": 16,
            "token_dim": 8,
            "d_model": 64,
            "nhead": 4,
            "num_layers": 1,
            "dim_feedforward": 128,
        },
        transformer_batch=4,
        transformer_batch_gpu=8,
        lenet_batch=32,
        train_warmup=1,
        train_repeats=5,
        lenet_repeats=5,
        memory_steps=1,
        memory_models=("lenet5",),
        memory_recipes=("fp32", "autocast", "O2"),
        accuracy_epochs=1,
        accuracy_batch=128,
        accuracy_seeds=1,
        matmul_size=256,
        matmul_size_gpu=1024,
    ),
}


def low_dtypes(device: str) -> list[torch.dtype]:
    """Low-precision dtypes worth timing on ``device``.

    CPU: bfloat16 only (float16 matrix products have no hardware units on common
    CPUs and run far slower than float32, so their timings say nothing about
    mixed precision). GPU: float16, and bfloat16 where the GPU has bfloat16 units.
    """
    if torch.device(device).type == "cpu":
        return [torch.bfloat16]
    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported(
        including_emulation=False
    ):
        return [torch.float16]  # pre-Ampere GPUs (V100, T4): no bfloat16 units
    return [torch.float16, torch.bfloat16]


def device_sync(device: str) -> Callable[[], None]:
    """A function that waits for ``device`` to finish queued work (no-op on CPU)."""
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


@dataclasses.dataclass
class Case:
    """One configuration in a timed comparison: ``prepare`` is untimed, ``run`` is timed."""

    name: str
    run: Callable[[], Any]
    prepare: Callable[[], Any] | None = None


def interleaved(
    cases: Sequence[Case], warmup: int, repeats: int, device: str = "cpu"
) -> dict[str, list[float]]:
    """Step every case once per round, alternating the order; return seconds per step.

    ``warmup`` untimed rounds come first (allocator, kernels, optimizer state).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sync = device_sync(device)
    for _ in range(warmup):
        for case in cases:
            if case.prepare is not None:
                case.prepare()
            case.run()
    sync()
    times: dict[str, list[float]] = {case.name: [] for case in cases}
    for i in range(repeats):
        order = cases if i % 2 == 0 else list(reversed(cases))
        for case in order:
            if case.prepare is not None:
                case.prepare()
            sync()
            start = time.perf_counter()
            case.run()
            sync()
            times[case.name].append(time.perf_counter() - start)
    return times


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of a list of step times (seconds)."""
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "n": len(samples),
    }


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over rounds of ``numerator[i] / denominator[i]``."""
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def paired_quartiles(
    numerator: Sequence[float], denominator: Sequence[float]
) -> tuple[float, float]:
    """First and third quartiles over rounds of ``numerator[i] / denominator[i]``."""
    ratios = sorted(n / d for n, d in zip(numerator, denominator, strict=True))
    return ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]


def _cpu_model() -> str:
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
                    return [flag for flag in wanted if flag in flags]
    except OSError:
        pass
    return []


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (other processes competing for the CPUs)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _git_commit() -> str | None:
    """The checkout's short commit, marked ``+dirty`` when the working tree has changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=here,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=here,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    return head + ("+dirty" if status else "")


def environment() -> dict[str, Any]:
    """The machine and software versions the numbers were measured with."""
    import numpy

    import mixprec

    env: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_env": {
            k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ
        },
        "load_average_at_start": load_average(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mixprec": mixprec.__version__,
        "git_commit": _git_commit(),
        "cuda_available": torch.cuda.is_available(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    return env


def run_child(module: str, args: Sequence[str], timeout: float = 600.0) -> dict[str, Any]:
    """Run ``python -m <module> <args>`` in a fresh process; parse its last stdout line as JSON.

    A fresh process gives every configuration its own peak-memory high-water mark.
    Raises ``RuntimeError`` with the child's stderr if it fails.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=root,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(
            f"python -m {module} {' '.join(args)} failed ({proc.returncode}):\n{tail}"
        )
    return json.loads(lines[-1])


def recorded_command(module: str, argv: list[str]) -> str:
    """``python -m module ARGS`` with the ``--out`` folder written ``$OUT``: where results
    went is the machine's business, not the report's.

    >>> recorded_command("benchmarks.gpu", ["--out", "/tmp/x", "--size", "smoke"])
    'python -m benchmarks.gpu --out $OUT --size smoke'
    """
    shown = ["$OUT" if i and argv[i - 1] == "--out" else arg for i, arg in enumerate(argv)]
    return " ".join([f"python -m {module}", *(a if a == "$OUT" else shlex.quote(a) for a in shown)])


def jsonable(value: Any) -> Any:
    """``value`` with dtypes, devices and tuples turned into plain JSON types."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.dtype | torch.device):
        return str(value).replace("torch.", "")
    return value


def workload_parser(doc: str, default_device: str = "cpu") -> argparse.ArgumentParser:
    """The command line every workload module shares: ``--preset`` and ``--device``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--device", default=default_device)
    return parser


def workload_main(
    doc: str,
    run: Callable[[Preset, str], Any],
    argv: list[str] | None = None,
    default_device: str = "cpu",
) -> None:
    """Run one workload on its own and print its result as JSON."""
    args = workload_parser(doc, default_device).parse_args(argv)
    print(json.dumps(run(PRESETS[args.preset], args.device), indent=1))
