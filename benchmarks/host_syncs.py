"""Workload 2: host syncs per optimizer step, counted (not timed) with ``HostSyncCounter``.

For the models and inner optimizers of workload 1, one steady-state step (after a
warm-up step that creates the optimizer state) is counted three ways:

* ``mixprec``: ``LossScaleOptimizer.step()`` (unscale, check, step or skip, scale update);
* ``gradscaler``: ``scaler.step(opt); scaler.update()``;
* ``inner``: the inner optimizer's own ``step()`` with no loss scaling.

A "sync" is a scalar read (``.item()``, ``bool(t)``) or a device-to-host copy. The
non-capturable Adam reads its per-parameter ``step`` counters with ``.item()``;
those counters live on the CPU, so on a GPU that is no device sync, but the
counter sees it: ``added = mixprec - inner`` is what the wrapper itself costs.
Target: ``added == 0`` with a fused inner optimizer, ``added <= 1`` otherwise.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from benchmarks._common import Preset, workload_main
from benchmarks.overhead import ScalingTrainer, build_models, optimizer_factories
from mixprec.tools._syncs import HostSyncCounter

__all__ = ["count_step", "run"]


def count_step(trainer: ScalingTrainer) -> tuple[int, list[str]]:
    """Host syncs of one steady-state optimizer step of ``trainer`` (and the ops seen)."""
    trainer.full_step()  # creates the optimizer state; its first-step reads are not counted
    trainer.backward()
    with HostSyncCounter() as syncs:
        trainer.opt_step()
    trainer.opt.zero_grad(set_to_none=True)
    return syncs.count, sorted(set(syncs.events))


def run(preset: Preset, device: str = "cpu") -> dict[str, Any]:
    rows = []
    for model_name, (model_factory, batch_factory) in build_models(preset).items():
        torch.manual_seed(0)
        base = model_factory().to(device)
        batch = tuple(t.to(device) for t in batch_factory())
        for opt_name, factory in optimizer_factories(device).items():
            counts: dict[str, int] = {}
            events: dict[str, list[str]] = {}
            for variant, label in (
                ("mixprec", "mixprec"),
                ("gradscaler", "gradscaler"),
                ("bare", "inner"),
            ):
                trainer = ScalingTrainer(variant, copy.deepcopy(base), factory, batch, device)
                counts[label], events[label] = count_step(trainer)
            added = counts["mixprec"] - counts["inner"]
            fused = "fused" in opt_name
            rows.append(
                {
                    "model": model_name,
                    "optimizer": opt_name,
                    "device": device,
                    "tensors": sum(1 for _ in base.parameters()),
                    **counts,
                    "added": added,
                    "gradscaler_added": counts["gradscaler"] - counts["inner"],
                    "target_added": 0 if fused else 1,
                    "meets_target": added <= (0 if fused else 1),
                    "events": events,
                }
            )
    return {
        "target": "syncs added by the wrapper: 0 with fused inner optimizers, <= 1 otherwise",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    workload_main(__doc__, run, argv)


if __name__ == "__main__":
    main()
