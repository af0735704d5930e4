"""Workload 5: accuracy parity on the digits task, every recipe against float32.

LeNet-5 on the embedded 8x8 digits (``mixprec.train.data.load_digits``: 1,438 training
and 359 test images, stratified split with seed 0), AdamW at lr 1e-2 decaying
linearly to 0, batch 64, the same number of steps for every recipe. One run per
seed (0, 1, 2 in the full suite); a seed fixes the initial weights and the batch
order, and every recipe is run with the same seeds. Reported: final test accuracy
and mean test cross-entropy (logits cast to float32), averaged over the seeds,
and their differences from float32.

Parity, as judged here: mean test accuracy within 1 percentage point of float32
(one test image is 0.28 points; the seed-to-seed spread of float32 is reported
next to it, since a run this short moves by about a point from one seed to the
next).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._common import Preset, low_dtypes, workload_main
from benchmarks.recipes import DTYPE_NAMES, RECIPES, build_recipe, workload_model
from mixprec.train.data import load_digits

__all__ = ["PARITY_POINTS", "train_and_test", "run"]

#: Largest accepted drop in mean test accuracy, in percentage points.
PARITY_POINTS = 1.0
LR = 1e-2
SPLIT_SEED = 0


def train_and_test(
    recipe_name: str, dtype: torch.dtype, device: str, preset: Preset, seed: int = 0
) -> dict[str, Any]:
    """Train LeNet-5 with one recipe and seed; return its test accuracy and loss."""
    x_train, y_train = load_digits("train", seed=SPLIT_SEED)
    x_test, y_test = load_digits("test", seed=SPLIT_SEED)
    x_train, y_train = x_train.to(device), y_train.to(device)
    x_test, y_test = x_test.to(device), y_test.to(device)
    recipe = build_recipe(
        recipe_name, lambda: workload_model("lenet5"), x_train[:2], device, dtype, lr=LR, seed=seed
    )
    order = torch.Generator().manual_seed(seed)
    per_epoch = -(-len(y_train) // preset.accuracy_batch)
    total = preset.accuracy_epochs * per_epoch
    # Linear decay to zero: the result does not hinge on where the last large step landed.
    schedule = torch.optim.lr_scheduler.LambdaLR(recipe.optimizer, lambda i: 1.0 - i / total)
    last_loss = torch.zeros(())
    for _ in range(preset.accuracy_epochs):
        perm = torch.randperm(len(y_train), generator=order).to(device)
        for start in range(0, len(perm), preset.accuracy_batch):
            idx = perm[start : start + preset.accuracy_batch]
            last_loss = recipe.step(x_train[idx], y_train[idx])
            schedule.step()
    logits = recipe.logits(x_test)
    return {
        "seed": seed,
        "steps": total,
        "test_accuracy": float((logits.argmax(1) == y_test).float().mean()),
        "test_loss": float(F.cross_entropy(logits, y_test)),
        "last_train_loss": float(last_loss),
    }


def run(preset: Preset, device: str = "cpu") -> dict[str, Any]:
    groups = []
    seeds = list(range(preset.accuracy_seeds))
    for dtype in low_dtypes(device):
        rows = []
        for name in RECIPES:
            runs = [train_and_test(name, dtype, device, preset, seed) for seed in seeds]
            accs = [r["test_accuracy"] for r in runs]
            rows.append(
                {
                    "recipe": name,
                    "dtype": "float32" if name == "fp32" else DTYPE_NAMES[dtype],
                    "steps": runs[0]["steps"],
                    "test_accuracy": statistics.fmean(accs),
                    "test_accuracy_per_seed": accs,
                    "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                    "test_loss": statistics.fmean(r["test_loss"] for r in runs),
                    "last_train_loss": statistics.fmean(r["last_train_loss"] for r in runs),
                }
            )
        ref = rows[0]
        for row in rows:
            row["accuracy_delta_points"] = 100 * (row["test_accuracy"] - ref["test_accuracy"])
            row["loss_delta"] = row["test_loss"] - ref["test_loss"]
            row["parity"] = row["accuracy_delta_points"] >= -PARITY_POINTS
        groups.append(
            {
                "model": "lenet5",
                "dtype": DTYPE_NAMES[dtype],
                "device": device,
                "epochs": preset.accuracy_epochs,
                "batch": preset.accuracy_batch,
                "seeds": seeds,
                "rows": rows,
            }
        )
    return {
        "target": f"mean test accuracy within {PARITY_POINTS:g} point of float32",
        "groups": groups,
    }


def main(argv: list[str] | None = None) -> None:
    workload_main(__doc__, run, argv)


if __name__ == "__main__":
    main()
