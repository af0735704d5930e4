"""``torch.compile`` side by side: compiled mixprec recipes against ``torch.autocast``.

For the transformer and LeNet-5 workloads of :mod:`benchmarks.throughput` (same
models, batches and presets), one run builds every recipe from the same weights
and steps them interleaved (one step each per round, order reversed every other
round): ``fp32`` and ``autocast`` eager (the anchors), then ``compile(fp32)``,
``compile(autocast)``, ``compile(O1)``, ``compile(O2)``, ``compile(O3)`` and
``compile(rewrite)``. "compile" is ``torch.compile`` of the prepared model (default
inductor mode); the optimizer step stays eager in every recipe, as in
:mod:`benchmarks.recipes`. Compiled recipes warm up for at least three rounds,
so compilation (and any recompilation) is over before timing starts.

Ratios are medians of per-round ratios: ``vs_autocast = t(autocast eager) /
t(recipe)`` and ``vs_compiled_autocast = t(compile(autocast)) / t(recipe)``.
Targets: every compiled mixprec recipe >= 1.0x ``compile(autocast)``; moonshot: the
best mixprec recipe >= 1.3x ``torch.autocast`` eager on the transformer, where the
CPU has bfloat16 units (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``;
without them bfloat16 is emulated and the ratios are reported, but are not a
comparison of fast paths)::

    python -m benchmarks.compiled --out benchmarks/results/compiled_cpu.json
    python -m benchmarks.compiled --quick      # small sizes
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks._common import (
    PRESETS,
    Case,
    environment,
    interleaved,
    jsonable,
    paired_quartiles,
    paired_ratio,
    summarize,
)
from benchmarks.recipes import DTYPE_NAMES, build_recipe, workload_model
from benchmarks.throughput import MODELS, batch_for

__all__ = ["COMPILED", "EAGER", "run", "run_model"]

#: Eager anchors, then the compiled recipes (``compile(NAME)``).
EAGER = ("fp32", "autocast")
COMPILED = ("fp32", "autocast", "O1", "O2", "O3", "rewrite")
MIXPREC = ("O1", "O2", "O3", "rewrite")


def _label(name: str, compiled: bool) -> str:
    return f"compile({name})" if compiled else name


def run_model(model_name: str, preset: Any, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Time every eager anchor and compiled recipe of one model, interleaved."""
    x, y = batch_for(model_name, preset, device)
    torch._dynamo.reset()
    recipes = {}
    for compiled, names in ((False, EAGER), (True, COMPILED)):
        for name in names:
            recipes[_label(name, compiled)] = build_recipe(
                name,
                lambda: workload_model(model_name, preset.transformer),
                x,
                device,
                dtype,
                compile_model=compiled,
            )
    cases = [Case(label, lambda r=r: r.step(x, y)) for label, r in recipes.items()]
    repeats = preset.train_repeats if model_name == "transformer" else preset.lenet_repeats
    times = interleaved(cases, max(preset.train_warmup, 3), repeats, device)
    rows = []
    for label, ts in times.items():
        q1, q3 = paired_quartiles(times["autocast"], ts)
        rows.append(
            {
                "recipe": label,
                **summarize(ts),
                "vs_fp32": paired_ratio(times["fp32"], ts),
                "vs_autocast": paired_ratio(times["autocast"], ts),
                "vs_autocast_q1": q1,
                "vs_autocast_q3": q3,
                "vs_compiled_autocast": paired_ratio(times["compile(autocast)"], ts),
            }
        )
    return {
        "model": model_name,
        "device": device,
        "dtype": DTYPE_NAMES[dtype],
        "batch": x.shape[0],
        "rows": rows,
    }


#: The issue's targets: (text, the ratio it reads, pick the worst (min) or best (max), bar).
TARGETS = (
    ("every compiled mixprec recipe >= 1.0x compile(autocast)", "vs_compiled_autocast", min, 1.0),
    ("best mixprec recipe >= 1.3x torch.autocast eager (moonshot)", "vs_autocast", max, 1.3),
)


def check(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of :data:`TARGETS` per model: met or not, with the measured value."""
    out = []
    for group in groups:
        by = {r["recipe"]: r for r in group["rows"]}
        mixprec = [by[_label(n, True)] for n in MIXPREC]
        for text, key, pick, bar in TARGETS:
            row = pick(mixprec, key=lambda r: r[key])
            which = "worst" if pick is min else "best"
            out.append(
                {
                    "model": group["model"],
                    "target": text,
                    "measured": f"{which} {row['recipe']} {row[key]:.2f}x",
                    "met": row[key] >= bar,
                }
            )
    return out


def run(preset_name: str = "full", device: str = "cpu") -> dict[str, Any]:
    preset = PRESETS[preset_name]
    dtype = torch.bfloat16 if torch.device(device).type == "cpu" else torch.float16
    groups = [run_model(m, preset, device, dtype) for m in MODELS]
    bf16_units = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return {
        "preset": preset_name,
        "bfloat16_units": bf16_units,
        "environment": environment(),
        "groups": groups,
        "targets": check(groups),
    }


def render(doc: dict[str, Any]) -> str:
    """Markdown tables: one per model, then the targets."""
    lines = [
        f"Preset `{doc['preset']}`; CPU bfloat16 units: "
        f"{'yes' if doc['bfloat16_units'] else 'no (bfloat16 emulated)'}.",
        "",
    ]
    for g in doc["groups"]:
        lines += [
            f"**{g['model']}** ({g['dtype']}, batch {g['batch']}, {g['device']})",
            "",
            "| recipe | median ms | vs fp32 | vs autocast eager (q1-q3) | vs compile(autocast) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in g["rows"]:
            lines.append(
                f"| {r['recipe']} | {1000 * r['median_s']:.2f} | {r['vs_fp32']:.2f}x | "
                f"{r['vs_autocast']:.2f}x ({r['vs_autocast_q1']:.2f}-{r['vs_autocast_q3']:.2f}) | "
                f"{r['vs_compiled_autocast']:.2f}x |"
            )
        lines.append("")
    lines += ["| model | target | measured | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        met = "yes" if t["met"] else "**no**"
        lines.append(f"| {t['model']} | {t['target']} | {t['measured']} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the quick preset's sizes")
    size.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    doc = run(preset, args.device)
    print(render(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(jsonable(doc), f, indent=2)


if __name__ == "__main__":
    main()
