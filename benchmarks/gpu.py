"""GPU benchmark: every precision recipe on a compute-bound transformer, eager and compiled.

::

    python -m benchmarks.gpu --out DIR                  # --size full on CUDA, 420 s budget
    python -m benchmarks.gpu --out DIR --size smoke --no-compile   # tiny, CPU: tests the script

The model (``--size full``) is mixprec's ``TransformerClassifier``: d_model 1024,
12 pre-norm encoder layers, 16 heads, feed-forward 4096, 1024 tokens of 64
features, batch 8, no dropout; 152M parameters and 8.67 TFLOP a training step:
large enough to be compute-bound on an H100-class GPU, small enough to fit its
memory in float32 with AdamW (``--batch`` changes the batch).
Every recipe of :func:`benchmarks.recipes.build_recipe` starts from the same
weights, uses AdamW with ``fused=True`` and a float32 loss. In priority order:

``autocast`` bf16, ``fp32``, ``O2``, ``O1``, ``O3``, ``rewrite`` (bf16), then float16:
``autocast+gradscaler`` (torch's), ``autocast+mixprec.GradScaler`` (the drop-in), ``O2``;

all eager first, then the host-sync check and the kernel profile, then the same list
(float32 last) under ``torch.compile`` (the model, default inductor mode; the
optimizer step stays eager). Each recipe is built in this process after the
previous one is freed and warmed up (eager: ``warmup`` steps; compiled: until two
steps in a row agree within 10 %, so compilation is over), then ``steps`` steps
are timed. Per recipe: median
step time, tokens/s, MFU, peak memory (``torch.cuda.max_memory_allocated``, reset per
recipe), whether the final loss is finite and the weights moved, and the ratios to
``autocast`` bf16 eager and compiled (:mod:`benchmarks.gpu_report`). A recipe that
raises (a compile error, out of memory) is recorded with its one-line error and the
run goes on.

``--budget-s``: no recipe starts when the time used plus the longest of its kind so far
(eager, check, compiled; before the first compiled one: 30 s plus three times the
longest eager) would pass the budget; it and the rest are recorded as skipped. One
that runs past the budget by 10 % (at least 20 s) is stopped, as is the run on
SIGINT; the outputs are written either way.

Outputs: ``DIR/gpu_results.json`` (everything) and ``DIR/gpu_results.md`` (a section
for BENCHMARKS.md), rewritten after every recipe so a run cut short keeps what it
measured; the Markdown is printed at the end. Exit status 0, or 1 when the run was
stopped by SIGINT or the hard deadline.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import environment, jsonable, recorded_command
from benchmarks.gpu_checks import host_sync_check, kernel_profile
from benchmarks.gpu_measure import (
    SIZES,
    Job,
    Workload,
    free_memory,
    matmul_rates,
    one_line,
    run_job,
    step_flops,
)
from benchmarks.gpu_report import annotate, render_markdown
from benchmarks.peers import PEER_RECIPES

__all__ = ["COMPILED_FIRST", "PEERS", "PRIORITY", "Budget", "main", "plan_jobs", "select_jobs"]

#: Recipes in the order they run (and are dropped last-first when time runs out).
PRIORITY: tuple[tuple[str, torch.dtype], ...] = (
    ("autocast", torch.bfloat16),
    ("fp32", torch.float32),
    ("O2", torch.bfloat16),
    ("O1", torch.bfloat16),
    ("O3", torch.bfloat16),
    ("rewrite", torch.bfloat16),
    ("autocast+gradscaler", torch.float16),
    ("autocast+mixprec.GradScaler", torch.float16),
    ("O2", torch.float16),
    ("O2+fp8", torch.bfloat16),  # float8 linear layers (the float8 issue's GPU row)
    ("O2+fp8-rowwise", torch.bfloat16),  # a scale per row, beside torchao's rowwise
    ("lean", torch.bfloat16),  # Kahan-compensated bfloat16, 8 bytes/param with AdamW
)
#: The specialists (``--peers``, :mod:`benchmarks.peers`), after mixprec's own recipes.
PEERS: tuple[tuple[str, torch.dtype], ...] = tuple((name, torch.bfloat16) for name in PEER_RECIPES)
#: Compiled, the recipes that the targets judge come first: compilations are the longest
#: items of the run, the first to fall off the end of the budget; float32 goes last.
COMPILED_FIRST = ("autocast", "O2", "O2+fp8", "torchao-fp8-tensorwise", "O2+fp8-rowwise",
                  "torchao-fp8-rowwise", "lean", "O3", "O1")  # fmt: skip


class OutOfTime(BaseException):
    """Raised by the hard-deadline alarm; a BaseException so no ``except Exception`` eats it."""


class Budget:
    """Seconds for the whole run; estimates each next item from the longest of its kind."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.spent: dict[str, list[float]] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def estimate(self, kind: str) -> float:
        past = self.spent.get(kind)
        if past:
            return max(past)
        if kind == "compiled":  # compilation dwarfs the eager steps; guess it generously
            return 30.0 + 3.0 * max(self.spent.get("eager", [0.0]))
        return max(self.spent.get("eager", [0.0]))

    def record(self, kind: str, seconds: float) -> None:
        self.spent.setdefault(kind, []).append(seconds)

    @property
    def hard_deadline(self) -> float:
        return self.seconds + max(20.0, 0.1 * self.seconds)


def plan_jobs(compile_too: bool, peers: bool = False) -> list[Job]:
    """Every recipe eager in :data:`PRIORITY` order (then :data:`PEERS`), then compiled.

    Compiled, the recipes of :data:`COMPILED_FIRST` lead in that order, the rest follow in
    eager order, and float32 goes last.
    """
    eager = [Job(recipe, dtype, False) for recipe, dtype in PRIORITY + (PEERS if peers else ())]
    if not compile_too:
        return eager

    def rank(job: Job) -> tuple[int, int]:
        first = job.recipe in COMPILED_FIRST and job.dtype == torch.bfloat16
        return (COMPILED_FIRST.index(job.recipe) if first else len(COMPILED_FIRST),
                job.recipe == "fp32")  # fmt: skip

    ordered = sorted(eager, key=rank)  # a stable sort: the rest keep their eager order
    return eager + [dataclasses.replace(job, compiled=True) for job in ordered]


def select_jobs(jobs: list[Job], labels: str | None) -> list[Job]:
    """The jobs whose labels ``labels`` (comma-separated) names, in plan order; all if None."""
    if labels is None:
        return jobs
    wanted = [label.strip() for label in labels.split(",") if label.strip()]
    known = {job.label for job in jobs}
    unknown = [label for label in wanted if label not in known]
    if unknown or not wanted:
        raise ValueError(
            f"--only {labels!r}: no recipe labelled {unknown or labels!r}; the labels are "
            + ", ".join(job.label for job in jobs)
        )
    return [job for job in jobs if job.label in wanted]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2, no usage dump
        print(f"python -m benchmarks.gpu: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_results.json and .md")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds (default 420)")
    parser.add_argument("--no-compile", action="store_true", help="eager recipes only")
    parser.add_argument("--no-checks", action="store_true",
                        help="leave out the host-sync check and the kernel profile")
    parser.add_argument("--peers", action="store_true",
                        help="also FlashOptim and torchao float8 (benchmarks.peers)")
    parser.add_argument("--only", metavar="LABELS",
                        help="comma-separated recipe labels, e.g. 'autocast bf16,compile(O2 bf16)'")
    parser.add_argument("--batch", type=int, help="batch size (default: the size's)")
    parser.add_argument("--steps", type=int, help="timed steps per recipe (default: the size's)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args(argv)
    if not 0 < args.budget_s < float("inf"):
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    for flag in ("batch", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be >= 1, got {value}; leave it out for the default")
    try:
        select_jobs(plan_jobs(not args.no_compile, args.peers), args.only)
    except ValueError as err:
        parser.error(str(err))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device must be 'cuda' or 'cpu', got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} is a file; give a folder (it is created if missing)")
    return args


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _gpu_details() -> dict[str, Any]:
    """Driver, cuDNN and Triton versions, and the float32 matmul setting the recipes ran with."""
    details: dict[str, Any] = {
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import triton

        details["triton"] = triton.__version__
    except ImportError:
        details["triton"] = None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
        details["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        details["driver"] = None
    return details


def _write(doc: dict[str, Any], out: str) -> str:
    annotate(doc)
    markdown = render_markdown(doc)
    with open(os.path.join(out, "gpu_results.json"), "w", encoding="utf-8") as f:
        json.dump(jsonable(doc), f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "gpu_results.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    return markdown


def _job_action(job: Job, work: Workload, doc: dict[str, Any]) -> Callable[[], None]:
    def action() -> None:
        row: dict[str, Any] = {
            "label": job.label,
            "recipe": job.recipe,
            "dtype": str(job.dtype).replace("torch.", ""),
            "mode": "compiled" if job.compiled else "eager",
        }
        doc["rows"].append(row)
        try:
            flops, bf16 = doc["flops"]["per_step"], doc["matmul"]["tflops"]["bfloat16"] * 1e12
            row.update(run_job(job, work, flops, bf16), status="ok")
            peak = row.get("above_baseline_mib")
            _log(
                f"    {job.label}: {row['median_s'] * 1e3:.1f} ms a step, MFU {row['mfu']:.1%}, "
                + ("" if peak is None else f"{peak:,.0f} MiB, ")
                + f"final loss {row['final_loss']:.4g}"
            )
        except Exception as err:  # recorded; the next recipe still runs
            row.update(status="failed", error=one_line(err))
            _log(traceback.format_exc())
        except OutOfTime:
            row.update(status="failed", error="stopped: past the budget's hard deadline")
            raise
        except KeyboardInterrupt:
            row.update(status="failed", error="stopped by SIGINT")
            raise
        finally:
            if job.compiled:
                torch._dynamo.reset()  # drop compiled graphs and the guards holding the model
            free_memory(work.device)

    return action


def _check_action(name: str, fn: Callable[[Workload], dict[str, Any]], work: Workload,
                  doc: dict[str, Any]) -> Callable[[], None]:  # fmt: skip
    def action() -> None:
        try:
            doc["checks"][name] = fn(work)
        except Exception as err:
            doc["checks"][name] = {"error": one_line(err)}
            _log(traceback.format_exc())
        free_memory(work.device)

    return action


def _schedule(
    work: Workload, doc: dict[str, Any], jobs: list[Job], checks: bool
) -> list[tuple[str, str, Callable[[], None]]]:
    """(label, kind, action) in running order: eager recipes, the checks, compiled recipes."""
    items = [(j.label, "eager", _job_action(j, work, doc)) for j in jobs if not j.compiled]
    if checks:
        sync = _check_action("host_syncs", host_sync_check, work, doc)
        items.append(("host-sync check", "check", sync))
        profile = _check_action("profile", kernel_profile, work, doc)
        items.append(("kernel profile", "check", profile))
    items += [(j.label, "compiled", _job_action(j, work, doc)) for j in jobs if j.compiled]
    return items


def _run_schedule(items: list, budget: Budget, doc: dict[str, Any], out: str) -> None:
    for index, (label, kind, action) in enumerate(items):
        estimate = budget.estimate(kind)
        if budget.elapsed() + estimate > budget.seconds:
            reason = (
                f"time budget: {budget.elapsed():.0f} s of {budget.seconds:.0f} s used, "
                f"the next needs about {estimate:.0f} s"
            )
            doc["skipped"] += [{"label": rest[0], "reason": reason} for rest in items[index:]]
            return
        _log(f"[{budget.elapsed():6.1f} s] {label} ...")
        start = time.monotonic()
        try:
            action()
        except (OutOfTime, KeyboardInterrupt) as stop:
            why = "hard deadline" if isinstance(stop, OutOfTime) else "SIGINT"
            doc["interrupted"] = f"{why} during {label} at {budget.elapsed():.0f} s"
            doc["skipped"] += [{"label": rest[0], "reason": why} for rest in items[index + 1 :]]
            return
        finally:
            budget.record(kind, time.monotonic() - start)
            doc["budget"]["used_s"] = budget.elapsed()
            _write(doc, out)


def _alarm(signum: int, frame: Any) -> None:
    raise OutOfTime()


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    args = _parse(raw)
    budget = Budget(args.budget_s)
    os.makedirs(args.out, exist_ok=True)
    overrides = {k: getattr(args, k) for k in ("batch", "steps") if getattr(args, k) is not None}
    size = dataclasses.replace(SIZES[args.size], **overrides)
    work = Workload.make(size, args.device)
    cuda = args.device == "cuda"
    env = environment()
    env.update(_gpu_details() if cuda else {})
    doc: dict[str, Any] = {
        "schema": 1,
        "command": recorded_command("benchmarks.gpu", raw),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else env["cpu_model"],
        "environment": env,
        "size": dataclasses.asdict(size),
        "timing": {
            "clock": "CUDA events between steps" if cuda else "host perf_counter per step",
            "warmup": f"eager: {size.warmup} steps; compiled: at least {max(size.warmup, 3)}, "
            "then until two steps in a row agree within 10 %",
        },
        "budget": {"seconds": budget.seconds, "hard_deadline_s": budget.hard_deadline},
        "rows": [],
        "skipped": [],
        "checks": {},
        "interrupted": None,
        "partial": True,
    }
    if hasattr(signal, "setitimer"):
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, budget.hard_deadline)
    try:
        _log(f"matmul rates and step FLOPs on {doc['device_name']} ...")
        doc["matmul"] = matmul_rates(args.device, size.matmul_n)
        doc["flops"] = step_flops(work)
        _write(doc, args.out)
        jobs = select_jobs(plan_jobs(not args.no_compile, args.peers), args.only)
        _run_schedule(_schedule(work, doc, jobs, not args.no_checks), budget, doc, args.out)
        if args.no_compile:
            compiled = select_jobs(plan_jobs(True, args.peers), None)
            doc["skipped"] += [
                {"label": j.label, "reason": "--no-compile"} for j in compiled if j.compiled
            ]
    except (OutOfTime, KeyboardInterrupt) as stop:  # before the schedule: rates or FLOPs
        doc["interrupted"] = f"{type(stop).__name__} before the recipes"
    finally:
        if hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)
    doc["partial"] = doc["interrupted"] is not None
    doc["budget"]["used_s"] = budget.elapsed()
    print(_write(doc, args.out), flush=True)
    _log(f"wrote gpu_results.json and gpu_results.md to {args.out}")
    return 1 if doc["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
