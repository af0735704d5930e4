"""Workload 4: peak memory of every recipe, each in a fresh process.

Every (model, dtype, recipe) of workload 3 runs in its own child process
(``python -m benchmarks.memory --child ...``), which imports everything, makes
its batch, runs a tiny throwaway step of the same architecture (library
initialisation), records a baseline, then builds the recipe and trains a few
steps:

* CPU: the process's resident-set high-water mark at the end (``peak_mib``). On
  Linux that is ``VmHWM`` from ``/proc/self/status``, first reset to the current
  RSS at the baseline (``/proc/self/clear_refs``), so the peak is that of
  training, not of the imports; ``above_baseline_mib`` is the peak minus the RSS
  at the baseline: the memory training itself needed. ``VmHWM`` is the mark that
  ``getrusage(RUSAGE_SELF).ru_maxrss`` reports, per address space: ``ru_maxrss``
  itself also carries the RSS of the parent a child was forked from across
  ``exec`` (and cannot be reset), so it is recorded (``process_max_rss_mib``) but
  not used. Elsewhere ``ru_maxrss`` is the fallback.
* GPU: ``torch.cuda.max_memory_allocated()`` (``peak_mib``), and its growth from
  the allocation before the model was built (``above_baseline_mib``).

Target: O2 and O3 below ``torch.autocast``.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import torch

from benchmarks._common import PRESETS, Preset, low_dtypes, run_child, workload_parser
from benchmarks.recipes import DTYPE_NAMES, RECIPES, build_recipe, make_optimizer, workload_model
from benchmarks.throughput import MODELS, batch_for
from mixprec.tools._memory import max_rss_mib, peak_rss_mib, proc_status_mib, reset_peak_rss

__all__ = ["measure", "run"]

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _warm_runtime(model_name: str, device: str, dtype: torch.dtype) -> None:
    """Run a tiny throwaway step of the same architecture, float32 and low precision.

    The first use of each kind of kernel initialises library state (thread pools,
    oneDNN primitives, cuBLAS handles) and the first optimizer imports
    ``torch._dynamo``: about 100 MiB together. Doing that before the baseline
    leaves the recipe's own memory above it.
    """
    tiny = {
        "seq_len": 4,
        "token_dim": 4,
        "d_model": 16,
        "nhead": 2,
        "num_layers": 1,
        "dim_feedforward": 16,
    }
    model = workload_model(model_name, tiny).to(device)
    x = torch.randn(2, 4, 4) if model_name == "transformer" else torch.rand(2, 1, 8, 8)
    x = x.to(device)
    opt = make_optimizer(model.parameters(), device)  # the first optimizer imports torch._dynamo
    for enabled in (False, True):
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=enabled):
            out = model(x)
        out.float().sum().backward()
        opt.step()
    del model, x, out, opt


def measure(
    model_name: str, recipe: str, dtype: torch.dtype, device: str, preset: Preset, steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps of one recipe in this process and report its peak memory."""
    # Import everything a recipe may touch before the baseline is taken.
    import mixprec.amp  # noqa: F401
    import mixprec.rewrite  # noqa: F401

    x, y = batch_for(model_name, preset, device)
    on_gpu = torch.device(device).type == "cuda"
    _warm_runtime(model_name, device, dtype)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() / 2**20
        reset = False
    else:
        # With the high-water mark reset, the peak is that of training alone; otherwise
        # it may still be the imports' or the warm-up's.
        reset = reset_peak_rss()
        current = proc_status_mib("VmRSS") if reset else None
        baseline = current if current is not None else peak_rss_mib()
    r = build_recipe(
        recipe, lambda: workload_model(model_name, preset.transformer), x, device, dtype
    )
    for _ in range(steps):
        r.step(x, y)
    if on_gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = peak_rss_mib()
    return {
        "model": model_name,
        "recipe": recipe,
        "dtype": DTYPE_NAMES[dtype],
        "device": device,
        "measure": "cuda.max_memory_allocated"
        if on_gpu
        else ("VmHWM" if proc_status_mib("VmHWM") is not None else "ru_maxrss"),
        "peak_reset_at_baseline": reset,
        "steps": steps,
        "baseline_mib": baseline,
        "peak_mib": peak,
        "above_baseline_mib": peak - baseline,
        "process_max_rss_mib": max_rss_mib(),
    }


def run(preset: Preset, device: str = "cpu", workers: int = 2) -> dict[str, Any]:
    """One child process per configuration, ``workers`` at a time (peaks are per process)."""
    recipes = preset.memory_recipes or RECIPES
    jobs = []
    for dtype in low_dtypes(device):
        for model_name in preset.memory_models:
            for recipe in recipes:
                args = [
                    "--child",
                    f"--model={model_name}",
                    f"--recipe={recipe}",
                    f"--dtype={DTYPE_NAMES[dtype]}",
                    f"--device={device}",
                    f"--preset={preset.name}",
                ]
                jobs.append(((DTYPE_NAMES[dtype], model_name), args))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: run_child("benchmarks.memory", job[1]), jobs))
    by_group: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (key, _), result in zip(jobs, results):
        by_group.setdefault(key, []).append(result)
    groups = []
    for (dtype_name, model_name), rows in by_group.items():
        auto = next((r for r in rows if r["recipe"] == "autocast"), None)
        for row in rows:
            if auto is not None and auto["above_baseline_mib"] > 0:
                row["vs_autocast"] = row["above_baseline_mib"] / auto["above_baseline_mib"]
        groups.append({"model": model_name, "dtype": dtype_name, "device": device, "rows": rows})
    return {"target": "O2 and O3 below torch.autocast (memory above baseline)", "groups": groups}


def main(argv: list[str] | None = None) -> None:
    parser = workload_parser(__doc__)
    parser.add_argument("--child", action="store_true", help="measure one configuration here")
    parser.add_argument("--model", choices=MODELS, default="transformer")
    parser.add_argument("--recipe", choices=RECIPES, default="fp32")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.child:
        result = measure(
            args.model, args.recipe, _DTYPES[args.dtype], args.device, preset, preset.memory_steps
        )
        print(json.dumps(result))
    else:
        print(json.dumps(run(preset, args.device), indent=1))


if __name__ == "__main__":
    main()
