"""Workload 3: training throughput (samples/s) of every recipe, interleaved in one loop.

Two models: a transformer encoder (4 layers, d=512, 8 heads, feed-forward 2048,
128 tokens of 16 features, batch 8 on a CPU and 64 on a GPU) and LeNet-5 on 8x8
images (batch 128). For each low-precision dtype of the device (bfloat16 on a CPU,
float16 and bfloat16 on a GPU) the recipes of :mod:`benchmarks.recipes`, float32
included, are built from the same weights and stepped one step each per round,
the order reversed every other round; each step is forward, float32 loss,
backward and optimizer step on a fixed random batch.

Ratios are medians over rounds of per-round ratios: ``speedup_vs_fp32 = t(fp32) /
t(recipe)`` and ``speedup_vs_autocast = t(autocast) / t(recipe)``.
Targets: O2 and the rewrite at least as fast as ``torch.autocast`` (>= 1.0); on a
CPU in bfloat16, the transformer at >= 2.5x float32.
"""

from __future__ import annotations

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
from benchmarks.recipes import DTYPE_NAMES, RECIPES, build_recipe, workload_model

__all__ = ["batch_for", "run", "MODELS"]

MODELS = ("transformer", "lenet5")


def batch_for(model_name: str, preset: Preset, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch ``(x, y)`` for ``model_name`` on ``device``."""
    g = torch.Generator().manual_seed(0)
    if model_name == "transformer":
        on_gpu = torch.device(device).type == "cuda"
        n = preset.transformer_batch_gpu if on_gpu else preset.transformer_batch
        dims = preset.transformer
        x = torch.randn(n, dims["seq_len"], dims["token_dim"], generator=g)
    else:
        n = preset.lenet_batch
        x = torch.rand(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x.to(device), y.to(device)


def run_model(model_name: str, preset: Preset, device: str, dtype: torch.dtype) -> dict[str, Any]:
    x, y = batch_for(model_name, preset, device)
    recipes = {
        name: build_recipe(
            name, lambda: workload_model(model_name, preset.transformer), x, device, dtype
        )
        for name in RECIPES
    }
    cases = [Case(name, lambda r=r: r.step(x, y)) for name, r in recipes.items()]
    repeats = preset.train_repeats if model_name == "transformer" else preset.lenet_repeats
    times = interleaved(cases, preset.train_warmup, repeats, device)
    batch = x.shape[0]
    rows = []
    for name, ts in times.items():
        stats = summarize(ts)
        q1, q3 = paired_quartiles(times["autocast"], ts)
        rows.append(
            {
                "recipe": name,
                **stats,
                "samples_per_s": batch / stats["median_s"],
                "speedup_vs_fp32": paired_ratio(times["fp32"], ts),
                "speedup_vs_autocast": paired_ratio(times["autocast"], ts),
                "speedup_vs_autocast_q1": q1,
                "speedup_vs_autocast_q3": q3,
            }
        )
    return {
        "model": model_name,
        "device": device,
        "dtype": DTYPE_NAMES[dtype],
        "batch": batch,
        "params": sum(p.numel() for p in recipes["fp32"].model.parameters()),
        "rows": rows,
    }


def run(preset: Preset, device: str = "cpu") -> dict[str, Any]:
    groups = []
    for dtype in low_dtypes(device):
        for model_name in MODELS:
            groups.append(run_model(model_name, preset, device, dtype))
    return {
        "targets": {
            "O2 and rewrite vs torch.autocast": ">= 1.0",
            "transformer bf16 vs float32 (CPU)": ">= 2.5",
        },
        "groups": groups,
    }


def main(argv: list[str] | None = None) -> None:
    workload_main(__doc__, run, argv)


if __name__ == "__main__":
    main()
