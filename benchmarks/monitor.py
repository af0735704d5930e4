"""Workload 7: the cost of the training-time precision monitor (``GradientMonitor``).

For LeNet-5 and the transformer encoder of workload 3, in each low-precision dtype of
the device, four copies of the ``O2`` recipe (same weights, fused AdamW, loss scaling
as the recipe has it) are stepped in one interleaved loop:

* ``bare``: the recipe alone;
* ``monitored``: with ``GradientMonitor(opt, model, every=100)`` attached, the default
  interval: steps between samples launch no kernel and sync nothing (the hook keeps
  references to the step's gradients, to name them if the step overflows);
* ``unnamed``: the same with ``name_overflows=False`` (samples only);
* ``sampling``: with ``every=1``, so that every step samples (exponent histograms of
  every gradient) and reads the sample back, as ``PrecisionMonitor`` does.

``between_samples`` is the paired ratio monitored / bare; a sampled step costs
``sample_extra`` = median(sampling) - median(monitored) more; the overhead at the
default interval is ``between_samples - 1 + sample_extra / every / median(bare)``.
Host syncs are counted (``HostSyncCounter``) on one steady-state step of each copy:
a step between samples and a sampled step must add none to the bare step's.
Targets: overhead <= 3 % of the step time at the default interval, 0 added syncs.

Run alone: ``python -m benchmarks.monitor --preset quick``.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks._common import (
    Case,
    Preset,
    interleaved,
    low_dtypes,
    paired_quartiles,
    paired_ratio,
    summarize,
    workload_main,
)
from benchmarks.recipes import DTYPE_NAMES, Recipe, build_recipe, workload_model
from benchmarks.throughput import MODELS, batch_for
from mixprec.diagnostics import DEFAULT_EVERY, GradientMonitor
from mixprec.tools._syncs import HostSyncCounter

__all__ = ["run", "run_model", "TARGET_OVERHEAD"]

#: The issue's bound on the monitor's share of the step time at the default interval.
TARGET_OVERHEAD = 0.03


def _syncs(recipe: Recipe, x: torch.Tensor, y: torch.Tensor, read: Any = None) -> int:
    """Host syncs of one steady-state step (and the sample read, if any)."""
    with HostSyncCounter() as counter:
        recipe.step(x, y)
        if read is not None:
            read()
    return counter.count


def run_model(model_name: str, preset: Preset, device: str, dtype: torch.dtype) -> dict[str, Any]:
    x, y = batch_for(model_name, preset, device)

    def build() -> Recipe:
        return build_recipe(
            "O2", lambda: workload_model(model_name, preset.transformer), x, device, dtype
        )

    bare, monitored, unnamed, sampling = build(), build(), build(), build()
    every = DEFAULT_EVERY
    default = GradientMonitor(monitored.optimizer, monitored.model, every=every, dtype=dtype)
    quiet = GradientMonitor(
        unnamed.optimizer, unnamed.model, every=every, dtype=dtype, name_overflows=False
    )
    always = GradientMonitor(sampling.optimizer, sampling.model, every=1, dtype=dtype)

    def sample_step() -> None:
        sampling.step(x, y)
        always.read_samples()  # one host sync: the callback reads every sample it takes

    cases = [
        Case("bare", lambda: bare.step(x, y)),
        Case("monitored", lambda: monitored.step(x, y)),
        Case("unnamed", lambda: unnamed.step(x, y)),
        Case("sampling", sample_step),
    ]
    # Effects of 1-3 % need more rounds than the throughput comparison takes.
    transformer = model_name == "transformer"
    repeats = 3 * preset.train_repeats if transformer else 10 * preset.lenet_repeats
    times = interleaved(cases, preset.train_warmup, repeats, device)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    between = paired_ratio(times["monitored"], times["bare"])
    q1, q3 = paired_quartiles(times["monitored"], times["bare"])
    sample_extra = max(medians["sampling"] - medians["monitored"], 0.0)
    overhead = between - 1.0 + sample_extra / every / medians["bare"]
    unnamed_between = paired_ratio(times["unnamed"], times["bare"])
    unnamed_overhead = unnamed_between - 1.0 + sample_extra / every / medians["bare"]

    # Syncs: the monitored copy's next step is between samples (its last sample was at
    # a step 1 + k * every, at least one step ago); the sampling copy samples every step.
    default.read_samples()
    bare_syncs = _syncs(bare, x, y)
    if (default.steps) % every == 0:  # the next step would sample: take it first
        monitored.step(x, y)
    between_syncs = _syncs(monitored, x, y)
    sampled_syncs = _syncs(sampling, x, y)
    read_syncs = _syncs(sampling, x, y, always.read_samples) - sampled_syncs
    for monitor in (default, quiet, always):
        monitor.remove()
    return {
        "model": model_name,
        "device": device,
        "dtype": DTYPE_NAMES[dtype],
        "params": sum(p.numel() for p in bare.model.parameters()),
        "tensors": sum(1 for _ in bare.model.parameters()),
        "every": every,
        "times": {name: summarize(ts) for name, ts in times.items()},
        "between_samples_ratio": between,
        "between_samples_q1": q1,
        "between_samples_q3": q3,
        "sample_extra_s": sample_extra,
        "overhead": overhead,
        "meets_target": overhead <= TARGET_OVERHEAD,
        "unnamed_between_samples_ratio": unnamed_between,
        "unnamed_overhead": unnamed_overhead,
        "syncs": {
            "bare": bare_syncs,
            "between_samples": between_syncs,
            "sampled": sampled_syncs,
            "added_between_samples": between_syncs - bare_syncs,
            "added_sampled": sampled_syncs - bare_syncs,
            "read_sample": read_syncs,
        },
    }


def run(preset: Preset, device: str = "cpu") -> dict[str, Any]:
    rows = [
        run_model(model_name, preset, device, dtype)
        for dtype in low_dtypes(device)
        for model_name in MODELS
    ]
    return {
        "target": f"overhead <= {TARGET_OVERHEAD:.0%} of the step time at every="
        f"{DEFAULT_EVERY}; 0 host syncs added between samples",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    workload_main(__doc__, run, argv)


if __name__ == "__main__":
    main()
