"""Where a training step's host time goes: Python functions, CUDA runtime calls, GPU idle.

::

    python -m benchmarks.gpu_host_profile --out DIR                    # CUDA, the GPU shapes
    python -m benchmarks.gpu_host_profile --out DIR --device cpu --size smoke

For each recipe of :mod:`benchmarks.gpu` (``--only`` picks labels, compiled ones too:
``"compile(O2 bf16)"``), on the benchmark's transformer and batch, after warm-up:

* ``step_ms``: the median of ``--steps`` whole steps (each one synchronised);
* ``python``: ``cProfile`` over the same number of steps: the functions with the most
  own time per step, and all Python calls per step;
* ``runtime`` (CUDA): ``torch.profiler`` over the same steps: each CUDA runtime call
  (``cudaLaunchKernel``, ``cudaStreamSynchronize``, ``cudaMemcpyAsync``...) with its
  count and host ms per step; a synchronising call in a step that should have none
  names the culprit;
* ``gpu_busy_ms`` (CUDA): the union of the kernels' intervals per step, so
  ``step_ms - gpu_busy_ms`` is the time the GPU waited for the host;
* ``idle`` (CUDA, ``--stacks``): what the host ran while the GPU waited. Each gap
  between kernels runs from the end of one to the launch of the next; the Python
  functions the profiler saw in that span (``with_stack``) share it, each by its own
  time (``self_ms``) and by its time with its callees (``cumulative_ms``, mixprec's
  functions only), per step.

Writes ``DIR/gpu_host_profile.json`` and ``.md`` and prints the Markdown.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
from typing import Any

import torch

from benchmarks._common import environment, jsonable, recorded_command
from benchmarks.gpu import plan_jobs, select_jobs
from benchmarks.gpu_measure import SIZES, Job, Workload, free_memory, one_line, timed_calls
from benchmarks.recipes import build_recipe

__all__ = ["DEFAULT_LABELS", "main", "profile_job"]

DEFAULT_LABELS = ("autocast bf16", "O2 bf16", "O1 bf16", "lean bf16",
                  "compile(autocast bf16)", "compile(O2 bf16)", "compile(O1 bf16)")  # fmt: skip


def _python_profile(step: Any, steps: int, top: int) -> dict[str, Any]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        rows.append({"function": where, "calls": calls / steps,
                     "own_ms": own * 1e3 / steps, "cumulative_ms": cumulative * 1e3 / steps})  # fmt: skip
    rows.sort(key=lambda row: -row["own_ms"])
    return {"calls_per_step": stats.total_calls / steps, "top": rows[:top]}  # type: ignore[attr-defined]


def _runtime_profile(step: Any, steps: int) -> dict[str, Any]:
    """CUDA runtime calls per step and the GPU's busy time per step (union of kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    calls: dict[str, list[float]] = {}
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if not event.name.startswith("Optimizer.") and not getattr(
                event, "is_user_annotation", False
            ):
                intervals.append((event.time_range.start, event.time_range.end))
        elif event.name.startswith("cu"):  # cudaLaunchKernel, cuLaunchKernelEx, ...
            calls.setdefault(event.name, []).append(event.time_range.elapsed_us() / 1e3)
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    runtime = sorted(
        ({"call": name, "per_step": len(ms) / steps, "host_ms": sum(ms) / steps}
         for name, ms in calls.items()),
        key=lambda row: -row["host_ms"],
    )  # fmt: skip
    return {"gpu_busy_ms": busy / 1e3 / steps, "runtime": runtime}


def idle_attribution(trace: dict[str, Any], steps: int, top: int = 15) -> dict[str, Any]:
    """Python time in the GPU's idle gaps, from a Chrome trace of ``steps`` steps."""
    events = trace["traceEvents"]
    on_gpu = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"))
        for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )  # fmt: skip
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}  # fmt: skip
    spans = []  # host spans the GPU waited through: a kernel's end to the next one's launch
    reach = on_gpu[0][1] if on_gpu else 0.0
    for start, end, correlation in on_gpu[1:]:
        launch = launched.get(correlation)
        if start > reach and launch is not None and launch > reach:
            spans.append((reach, min(launch, start)))
        reach = max(reach, end)
    python = [e for e in events if e.get("cat") == "python_function"]
    children: dict[Any, list[dict[str, Any]]] = {}
    for e in python:
        children.setdefault(e["args"].get("Python parent id"), []).append(e)

    starts = [a for a, _ in spans]
    before = list(itertools.accumulate((b - a for a, b in spans), initial=0.0))

    def covered(t: float) -> float:  # the spans' length before time t
        i = bisect.bisect_right(starts, t) - 1
        return 0.0 if i < 0 else before[i] + min(t, spans[i][1]) - spans[i][0]

    def overlap(e: dict[str, Any]) -> float:
        return covered(e["ts"] + e["dur"]) - covered(e["ts"])

    own: dict[str, float] = {}
    cumulative: dict[str, float] = {}
    for e in python:
        total = overlap(e)
        if not total:
            continue
        inner = sum(overlap(c) for c in children.get(e["args"].get("Python id"), ()))
        own[e["name"]] = own.get(e["name"], 0.0) + total - inner
        if "mixprec" in e["name"]:
            cumulative[e["name"]] = cumulative.get(e["name"], 0.0) + total

    def ranked(table: dict[str, float], key: str) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda item: -item[1])[:top]
        return [{"function": _short(name), key: us / 1e3 / steps} for name, us in rows]

    return {
        "gaps_per_step": len(spans) / steps,
        "idle_ms": sum(b - a for a, b in spans) / 1e3 / steps,
        "self": ranked(own, "self_ms"),
        "mixprec_cumulative": ranked(cumulative, "cumulative_ms"),
    }


def _short(name: str) -> str:
    """``.../site-packages/torch/nn/modules/module.py(1795): inner`` -> ``torch/nn/modules/...``."""
    for root in ("site-packages/", "src/"):
        if root in name:
            return name.split(root, 1)[1]
    if "torchinductor" in name:  # generated code in inductor's cache folder
        return "<inductor cache>/" + name.rsplit("/", 1)[-1]
    return name


def _stack_trace(step: Any, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def profile_job(job: Job, work: Workload, steps: int, top: int = 15,
                stacks: bool = False) -> dict[str, Any]:  # fmt: skip
    """One recipe: median step, then its Python and (CUDA) runtime profiles."""
    recipe = build_recipe(job.recipe, work.model, work.x, work.device, job.dtype,
                          compile_model=job.compiled)  # fmt: skip

    def step() -> Any:
        return recipe.step(work.x, work.y)

    for _ in range(6 if job.compiled else 3):
        step()
    row: dict[str, Any] = {
        "label": job.label,
        "step_ms": statistics.median(timed_calls(step, work.device, 0, steps)) * 1e3,
        "python": _python_profile(step, steps, top),
    }
    if work.device == "cuda":
        row.update(_runtime_profile(step, steps))
        if stacks:
            row["idle"] = idle_attribution(_stack_trace(step, steps), steps, top)
    return row


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"Host profile, {doc['device']}, batch {doc['batch']}; command: `{doc['command']}`",
        "",
    ]
    for row in doc["rows"]:
        if "error" in row:
            lines += [f"### {row['label']}: {row['error']}", ""]
            continue
        busy = row.get("gpu_busy_ms")
        idle = (
            ""
            if busy is None
            else f", GPU busy {busy:.2f} ms ({row['step_ms'] - busy:.2f} ms idle)"
        )
        lines += [f"### {row['label']}: {row['step_ms']:.2f} ms a step{idle}, "
                  f"{row['python']['calls_per_step']:.0f} Python calls a step", "",
                  "| function | calls/step | own ms/step | cumulative ms/step |",
                  "|---|--:|--:|--:|"]  # fmt: skip
        for fn in row["python"]["top"]:
            lines.append(f"| `{fn['function']}` | {fn['calls']:.0f} | {fn['own_ms']:.3f} | "
                         f"{fn['cumulative_ms']:.3f} |")  # fmt: skip
        if "runtime" in row:
            lines += ["", "| CUDA runtime call | per step | host ms/step |", "|---|--:|--:|"]
            lines += [f"| `{r['call']}` | {r['per_step']:.0f} | {r['host_ms']:.3f} |"
                      for r in row["runtime"][:10]]  # fmt: skip
        if "idle" in row:
            idle_rows = row["idle"]
            lines += ["", f"GPU idle: {idle_rows['idle_ms']:.2f} ms a step in "
                      f"{idle_rows['gaps_per_step']:.0f} gaps; the host meanwhile:", "",
                      "| Python function (own time in the gaps) | ms/step |", "|---|--:|"]  # fmt: skip
            lines += [f"| `{r['function']}` | {r['self_ms']:.3f} |" for r in idle_rows["self"]]
            lines += ["", "| mixprec function (with callees, in the gaps) | ms/step |", "|---|--:|"]
            lines += [f"| `{r['function']}` | {r['cumulative_ms']:.3f} |"
                      for r in idle_rows["mixprec_cumulative"]]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_host_profile",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=",".join(DEFAULT_LABELS), help="comma-separated labels")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--stacks",
        action="store_true",
        help="CUDA: attribute the GPU's idle time to Python functions",
    )
    args = parser.parse_args(argv)
    try:
        jobs = select_jobs(plan_jobs(compile_too=True), args.only)
    except ValueError as err:
        parser.error(str(err))
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    work = Workload.make(SIZES[args.size], args.device)
    doc: dict[str, Any] = {
        "command": recorded_command("benchmarks.gpu_host_profile", sys.argv[1:] if argv is None else argv),
        "environment": environment(), "device": args.device, "batch": work.size.batch, "rows": [],
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    for job in jobs:
        print(f"host profile: {job.label}", file=sys.stderr, flush=True)
        try:
            doc["rows"].append(profile_job(job, work, args.steps, stacks=args.stacks))
        except Exception as err:  # a recipe that cannot run is reported, the rest go on
            doc["rows"].append({"label": job.label, "error": one_line(err)})
        free_memory(args.device)
        with open(os.path.join(args.out, "gpu_host_profile.json"), "w", encoding="utf-8") as f:
            json.dump(jsonable(doc), f, indent=1)
        text = render(doc)
        with open(os.path.join(args.out, "gpu_host_profile.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
