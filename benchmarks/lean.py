"""Lean low-precision training side by side: every ``master_weights=`` mode with AdamW.

One run trains the same small MLP regression (full batch, AdamW at a learning rate
where bfloat16 ulps swallow single updates) with each mode over several seeds, and,
where installed, ``torch-optimi``'s Kahan-summation AdamW on the same bfloat16 model.
``split8`` and ``split8-8bit`` are :class:`~mixprec.optim.Split8MasterWeights` (bfloat16
weight + int8 correction, the update in float32) around torch's AdamW and around
:class:`~mixprec.optim.AdamW8bit` (8-bit moments; ``split8-8bit-inner-fused``, not
run by default, compiles AdamW8bit's own step inside the eager masters' step);
``kahan-fused``, ``stochastic-fused``, ``split8-fused``, ``split8-8bit-fused`` and
``fp32-fused`` (not run by default) are the compiled master-weight steps; ``--modes``
runs a subset.
Per mode: bytes per parameter (live tensor storage after training: parameters,
optimizer state, masters or buffers), the optimizer step's time as the median of its
per-step ratios to float32 masters (``fp32``; the modes of a seed train in lockstep,
one step each per round, so every ratio pairs steps taken moments apart), and the
final float32-evaluated loss (mean over seeds)::

    python -m benchmarks.lean --steps 600 --seeds 5 --out results/lean.json

``--main-job`` instead trains the main job's models (``mixprec compare``: the
digits, the one-cycle AdamW schedule, default epochs) at O0 (float32), O2 (float32
masters), O3 (pure bfloat16) and lean (Kahan-compensated bfloat16), several seeds
each, and reports test accuracy (mean, and each seed) per level::

    python -m benchmarks.lean --main-job --models mlp,lenet5,transformer --seeds 3
    python -m benchmarks.lean --main-job --levels O2,O2+split8 --seeds 3
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import Case, interleaved, paired_quartiles, paired_ratio
from mixprec.optim import AdamW8bit, LossScaleOptimizer, Split8MasterWeights
from mixprec.tools._memory import live_tensor_bytes

__all__ = ["held_bytes_per_param", "run"]

MODES = ("float32", "fp32", "split", "kahan", "stochastic", "split8", "split8-8bit", "bf16",
         "optimi-kahan")
#: Not run by default, as their first step compiles (``torch.compile``):
#: ``AdamW8bit(fused=True)``, and the compiled master-weight steps (the default with
#: ``AdamW(fused=True)`` on a GPU).
EXTRA_MODES = ("split8-8bit-fused", "split8-8bit-inner-fused", "kahan-fused",
               "stochastic-fused", "split8-fused", "fp32-fused")


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=gen)
    return x, x @ torch.randn(16, 1, generator=gen) + 0.1 * torch.randn(256, 1, generator=gen)


def _model(seed: int, width: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)]
    return torch.nn.Sequential(*layers).to(dtype)


def _optimizer(mode: str, model: torch.nn.Module, lr: float) -> Any:
    params = model.parameters()
    if mode == "optimi-kahan":
        import optimi  # benchmark-only dependency: pip install torch-optimi

        inner = optimi.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                             kahan_sum=True)  # fmt: skip
        return LossScaleOptimizer(inner)
    if mode.startswith("split8"):  # built directly: the masters around the inner step
        if mode in ("split8", "split8-fused"):
            inner = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=mode != "split8")
        else:  # split8-8bit-inner-fused: AdamW8bit's own compiled step, eager masters
            compiled = True if mode == "split8-8bit-inner-fused" else None
            inner = AdamW8bit(params, lr=lr, weight_decay=0.0, fused=compiled)
        fused = mode in ("split8-fused", "split8-8bit-fused")
        # The fused step reads the model's gradients: bfloat16 without loss scaling.
        opt = LossScaleOptimizer(inner, loss_scale=None if fused else "dynamic")
        opt._master = Split8MasterWeights(inner)
        opt._master.fused = fused  # compiled on any device, as on a GPU
        return opt
    if mode in ("kahan-fused", "stochastic-fused", "fp32-fused"):
        inner = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
        # The fused fp32 step reads the model's gradients: bfloat16 without loss scaling.
        scale = None if mode == "fp32-fused" else "dynamic"
        opt = LossScaleOptimizer(inner, scale, master_weights=mode.removesuffix("-fused"))
        opt._master.fused = True  # compiled on any device, as on a GPU by default
        return opt
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    wrapped = False if mode in ("float32", "bf16") else mode
    return LossScaleOptimizer(inner, master_weights=wrapped)


def _inputs(mode: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data(seed)
    return x.to(torch.float32 if mode == "float32" else torch.bfloat16), y


def _trainer(mode: str, seed: int, lr: float, width: int,
             data: tuple[torch.Tensor, torch.Tensor]) -> tuple[Case, torch.nn.Module, Any]:  # fmt: skip
    """One (mode, seed) on ``data`` (:func:`_inputs`): its model, optimizer and a
    :class:`Case` whose ``prepare`` is the untimed forward and backward and whose
    ``run`` is the timed optimizer step."""
    x_in, y = data
    model = _model(seed, width, x_in.dtype)
    opt = _optimizer(mode, model, lr)

    def forward_backward() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x_in).float(), y)
        opt.scale_loss(loss).backward()

    return Case(mode, opt.step, forward_backward), model, opt


def held_bytes_per_param(mode: str, seed: int, lr: float, width: int) -> float:
    """Live tensor bytes per parameter of one (mode, seed) after two steps and
    ``zero_grad``: parameters, optimizer state, masters or buffers (their sizes are
    fixed from the first step on)."""
    data = _inputs(mode, seed)
    baseline = live_tensor_bytes()
    case, model, opt = _trainer(mode, seed, lr, width, data)
    for _ in range(2):
        assert case.prepare is not None
        case.prepare()
        case.run()
    opt.zero_grad()
    return (live_tensor_bytes() - baseline) / sum(p.numel() for p in model.parameters())


def _final_loss(model: torch.nn.Module, seed: int) -> float:
    x, y = _data(seed)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(copy.deepcopy(model).float()(x), y))


def run(steps: int, seeds: int, lr: float, width: int,
        modes: tuple[str, ...] = MODES) -> dict[str, Any]:  # fmt: skip
    """Train every mode on every seed, the modes of a seed in lockstep (one step each
    per round, the order alternating: :func:`benchmarks._common.interleaved`), so that
    step times are paired; ratios are medians of per-step ratios to ``fp32`` masters."""
    rows: dict[str, Any] = {}
    available = []
    for mode in modes:
        try:
            rows[mode] = {"bytes_per_param": round(held_bytes_per_param(mode, 0, lr, width), 2)}
            available.append(mode)
        except ImportError as exc:
            rows[mode] = {"skipped": f"{exc}"}
    times: dict[str, list[float]] = {m: [] for m in available}
    losses: dict[str, list[float]] = {m: [] for m in available}
    for seed in range(seeds):
        built = {m: _trainer(m, seed, lr, width, _inputs(m, seed)) for m in available}
        seed_times = interleaved([case for case, _, _ in built.values()], 0, steps)
        for m, (_, model, _) in built.items():
            times[m] += seed_times[m]
            losses[m].append(_final_loss(model, seed))
    for m in available:
        rows[m].update({
            "step_s": statistics.median(times[m]),
            "loss_mean": statistics.mean(losses[m]),
            "loss_stdev": statistics.stdev(losses[m]) if seeds > 1 else 0.0,
            "loss_per_seed": losses[m],
        })  # fmt: skip
    if "fp32" in times:
        anchor, anchor_loss = times["fp32"], rows["fp32"]["loss_mean"]
        for m in available:
            rows[m]["step_time_vs_fp32_masters"] = round(paired_ratio(times[m], anchor), 3)
            rows[m]["step_time_quartiles"] = [
                round(q, 3) for q in paired_quartiles(times[m], anchor)
            ]
            rows[m]["loss_vs_fp32_masters_pct"] = round(
                100 * (rows[m]["loss_mean"] / anchor_loss - 1), 2)
    return {"steps": steps, "seeds": seeds, "lr": lr, "width": width, "modes": rows}


MAIN_JOB_LEVELS = "O0,O2,O3,lean"


def main_job(models: list[str], seeds: int, threads: int,
             levels: str = MAIN_JOB_LEVELS) -> dict[str, Any]:  # fmt: skip
    """Test accuracy and loss of each ``mixprec compare`` entry of ``levels`` per model,
    over ``seeds``."""
    from mixprec.cli import main as mixprec_main

    out: dict[str, Any] = {}
    for model in models:
        runs: dict[str, list[float]] = {}
        losses: dict[str, list[float]] = {}
        for seed in range(seeds):
            with tempfile.TemporaryDirectory() as folder:
                argv = ["compare", "--levels", levels, "--model", model, "--seed",
                        str(seed), "--threads", str(threads), "--quiet", "--out", folder]  # fmt: skip
                if mixprec_main(argv) != 0:
                    raise RuntimeError(f"mixprec {' '.join(argv)} failed")
                for row in json.loads((Path(folder) / "compare.json").read_text()):
                    runs.setdefault(row["config"], []).append(row["accuracy"])
                    losses.setdefault(row["config"], []).append(row["loss"])
        out[model] = {
            level: {
                "mean": statistics.mean(accs),
                "per_seed": accs,
                "loss_mean": statistics.mean(losses[level]),
                "loss_stdev": statistics.stdev(losses[level]) if seeds > 1 else 0.0,
                "loss_per_seed": losses[level],
            }
            for level, accs in runs.items()
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of: " + ", ".join(MODES + EXTRA_MODES))
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    parser.add_argument("--main-job", action="store_true", help="the main job's models instead")
    parser.add_argument("--models", default="mlp,lenet5,transformer")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (both jobs)")
    parser.add_argument("--levels", default=MAIN_JOB_LEVELS,
                        help="with --main-job: compare entries, e.g. O2,O2+split8")  # fmt: skip
    args = parser.parse_args(argv)
    if args.main_job:
        result = main_job(args.models.split(","), args.seeds, args.threads, args.levels)
        for model, levels in result.items():
            for level, row in levels.items():
                seeds = " ".join(f"{a:.4f}" for a in row["per_seed"])
                print(f"{model:12} {level:18} mean {row['mean']:.4f}   seeds {seeds}   "
                      f"test loss {row['loss_mean']:.4f} ({row['loss_stdev']:.4f})")  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    modes = tuple(args.modes.split(","))
    unknown = sorted(set(modes) - set(MODES + EXTRA_MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES + EXTRA_MODES)}")
    torch.set_num_threads(args.threads)
    result = run(args.steps, args.seeds, args.lr, args.width, modes)
    print(f"{'mode':14} {'B/param':>8} {'step vs fp32 [quartiles]':>26} {'loss mean':>10} "
          f"{'stdev':>8} {'vs fp32':>8}")  # fmt: skip
    for mode, row in result["modes"].items():
        if "skipped" in row:
            print(f"{mode:14} skipped: {row['skipped']}")
            continue
        low, high = row.get("step_time_quartiles", (float("nan"), float("nan")))
        ratio = row.get("step_time_vs_fp32_masters", float("nan"))
        print(f"{mode:14} {row['bytes_per_param']:8.2f} "
              f"{f'{ratio:.3f} [{low:.3f}, {high:.3f}]':>26} "
              f"{row['loss_mean']:10.4f} {row['loss_stdev']:8.4f} "
              f"{row.get('loss_vs_fp32_masters_pct', float('nan')):+7.2f}%")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
