"""The suite behind ``python -m benchmarks``: run the workloads, write JSON and Markdown.

::

    python -m benchmarks                       # full CPU suite (+ GPU suite if CUDA is available)
    python -m benchmarks --quick               # the same workloads, small sizes, under a minute
    python -m benchmarks --smoke               # tiny sizes, for the smoke test
    python -m benchmarks --markdown BENCHMARKS.md   # also (re)write the published report
    python -m benchmarks --only throughput,memory   # a subset of the workloads

``python -m benchmarks`` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the variable is
already set: on a machine shared with other jobs, OpenMP's default spinning
worker threads turn contended parallel regions into scheduling stalls (steps
then vary by 10x or more, the ratios mean nothing, and a small workload can take
minutes). Set ``OMP_WAIT_POLICY=ACTIVE`` to time the default on a dedicated
machine. ``--threads N`` sets the torch threads.

Writes ``results.json`` (every sample, the environment, the targets) and
``results.md`` into ``--out`` (default ``bench_out/``). ``--markdown PATH``
replaces the generated part of PATH and keeps a hand-written analysis that
follows the line ``<!-- analysis: kept when the report is regenerated -->``.
Exits with status 1 if a workload failed (its error is in the outputs); missed
targets are results, not failures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import (
    accuracy,
    distributed,
    host_syncs,
    memory,
    mfu,
    monitor,
    overhead,
    throughput,
)
from benchmarks._common import PRESETS, Preset, environment, jsonable, load_average
from benchmarks.report import check_targets, render_markdown

WORKLOADS: dict[str, Callable[[Preset, str, dict[str, Any]], dict[str, Any]]] = {
    "overhead": lambda preset, device, done: overhead.run(preset, device),
    "host_syncs": lambda preset, device, done: host_syncs.run(preset, device),
    "throughput": lambda preset, device, done: throughput.run(preset, device),
    "memory": lambda preset, device, done: memory.run(preset, device),
    "accuracy": lambda preset, device, done: accuracy.run(preset, device),
    "mfu": lambda preset, device, done: mfu.run(preset, device, done.get("throughput")),
    "monitor": lambda preset, device, done: monitor.run(preset, device),
    "distributed": lambda preset, device, done: distributed.run(preset, device),
}

NO_GPU_NOTE = (
    "No CUDA device in this run: the GPU suite (every workload on the GPU in float16 and "
    "bfloat16, peak memory by torch.cuda.max_memory_allocated, and model FLOP utilisation "
    "against the GPU's measured bfloat16 matmul rate) was skipped. It runs automatically "
    "when torch.cuda.is_available()."
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the mixprec benchmark suite; write results.json and a Markdown report.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes: under a minute on 2 cores")
    size.add_argument("--smoke", action="store_true", help="tiny sizes: checks the suite runs")
    parser.add_argument("--out", default="bench_out", help="output folder (default: bench_out)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the Markdown report here")
    parser.add_argument(
        "--only",
        metavar="LIST",
        help=f"comma-separated workloads to run, from: {', '.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch threads here and in the memory children (default: torch's own choice)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): the CPU suite, plus the GPU suite when CUDA is available",
    )
    args = parser.parse_args(argv)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown or not names:
            parser.error(
                f"--only: unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}"
            )
        args.workloads = [n for n in WORKLOADS if n in names]
    else:
        args.workloads = list(WORKLOADS)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    return args


OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")

#: In a published report, everything from this line on is written by hand and kept
#: when ``--markdown`` rewrites the file (the generated part above it is replaced).
ANALYSIS_MARKER = "<!-- analysis: kept when the report is regenerated -->"


def _kept_analysis(path: str) -> str:
    """The hand-written tail of an existing report (from :data:`ANALYSIS_MARKER` on), or ""."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    at = text.find(ANALYSIS_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, defaulted: tuple[str, ...] = ()) -> int:
    """Run the suite; return the exit status (0, or 1 if a workload raised).

    ``defaulted`` names the environment variables that ``python -m benchmarks``
    set itself; the recorded command shows only those the user set.
    """
    raw = sys.argv[1:] if argv is None else list(argv)
    args = _parse(raw)
    # OpenMP settings change CPU timings; the recorded command carries the user's.
    env_prefix = [
        f"{k}={shlex.quote(os.environ[k])}"
        for k in OMP_VARIABLES
        if k in os.environ and k not in defaulted
    ]
    preset = PRESETS["smoke" if args.smoke else "quick" if args.quick else "full"]
    devices = []
    if args.device in ("auto", "cpu"):
        devices.append("cpu")
    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        devices.append("cuda")
    notes = [] if torch.cuda.is_available() else [NO_GPU_NOTE]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the memory children

    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    env = environment()
    env["omp_env_set_by_suite"] = [k for k in defaulted if k in os.environ]
    results: dict[str, dict[str, Any]] = {}
    failed = False
    for device in devices:
        done: dict[str, Any] = {}
        for name in args.workloads:
            _log(f"[{device}] {name} ...")
            t0 = time.perf_counter()
            try:
                section = WORKLOADS[name](preset, device, done)
            except Exception as err:  # one failing workload must not hide the others
                failed = True
                section = {"error": f"{type(err).__name__}: {err}"}
                _log(traceback.format_exc())
            section["duration_s"] = time.perf_counter() - t0
            _log(f"[{device}] {name} done in {section['duration_s']:.1f} s")
            done[name] = section
        results[device] = done

    env["load_average_at_end"] = load_average()
    doc: dict[str, Any] = {
        "schema": 1,
        "command": " ".join([*env_prefix, "python -m benchmarks", *map(shlex.quote, raw)]),
        "preset": preset.name,
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": time.perf_counter() - start,
        "environment": env,
        "devices": devices,
        "workloads": args.workloads,
        "notes": notes,
        "results": results,
    }
    doc["targets"] = check_targets(results)
    doc = jsonable(doc)
    markdown = render_markdown(doc)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    if args.markdown:
        kept = _kept_analysis(args.markdown)
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown + kept)
    met = sum(1 for c in doc["targets"] if c["met"])
    _log(
        f"{met} of {len(doc['targets'])} targets met; wrote results.json and results.md to "
        f"{args.out}" + (f" and {args.markdown}" if args.markdown else "")
    )
    return 1 if failed else 0
