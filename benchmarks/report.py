"""Targets and the Markdown report, both computed from the suite's JSON results."""

from __future__ import annotations

from typing import Any

from benchmarks import distributed

__all__ = ["check_targets", "render_markdown"]


def _ms(seconds: float) -> str:
    ms = 1e3 * seconds
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the issue, with the measured value and whether it is met."""
    checks: list[dict[str, Any]] = []
    for device, all_work in results.items():
        work = {k: v for k, v in all_work.items() if "error" not in v}
        overhead = work.get("overhead")
        if overhead:
            for row in overhead["rows"]:
                for phase in ("full_step", "step_only"):
                    ratio = row[phase]["ratio"]
                    checks.append(
                        {
                            "device": device,
                            "workload": "overhead",
                            "what": f"{row['model']} {row['optimizer']} {phase.replace('_', '-')}: "
                            "mixprec / GradScaler time",
                            "value": round(ratio, 3),
                            "target": "<= 1.0",
                            "met": ratio <= 1.0,
                        }
                    )
                    if "scaler_ratio" in row[phase]:
                        scaler_ratio = row[phase]["scaler_ratio"]
                        checks.append(
                            {
                                "device": device,
                                "workload": "overhead",
                                "what": f"{row['model']} {row['optimizer']} "
                                f"{phase.replace('_', '-')}: mixprec.GradScaler / GradScaler time",
                                "value": round(scaler_ratio, 3),
                                "target": "<= 1.0",
                                "met": scaler_ratio <= 1.0,
                            }
                        )
        syncs = work.get("host_syncs")
        if syncs:
            for row in syncs["rows"]:
                checks.append(
                    {
                        "device": device,
                        "workload": "host_syncs",
                        "what": f"{row['model']} {row['optimizer']}: syncs added by the wrapper",
                        "value": row["added"],
                        "target": f"<= {row['target_added']}",
                        "met": row["meets_target"],
                    }
                )
        throughput = work.get("throughput")
        if throughput:
            for group in throughput["groups"]:
                rows = {r["recipe"]: r for r in group["rows"]}
                for recipe in ("O2", "rewrite"):
                    value = rows[recipe]["speedup_vs_autocast"]
                    checks.append(
                        {
                            "device": device,
                            "workload": "throughput",
                            "what": f"{group['model']} {group['dtype']} {recipe}: speed vs torch.autocast",
                            "value": round(value, 3),
                            "target": ">= 1.0",
                            "met": value >= 1.0,
                        }
                    )
                if (
                    device == "cpu"
                    and group["model"] == "transformer"
                    and group["dtype"] == "bfloat16"
                ):
                    for recipe in ("O2", "rewrite"):
                        value = rows[recipe]["speedup_vs_fp32"]
                        checks.append(
                            {
                                "device": device,
                                "workload": "throughput",
                                "what": f"transformer bfloat16 {recipe}: speed vs float32",
                                "value": round(value, 3),
                                "target": ">= 2.5",
                                "met": value >= 2.5,
                            }
                        )
        memory = work.get("memory")
        if memory:
            for group in memory["groups"]:
                for row in group["rows"]:
                    if row["recipe"] in ("O2", "O3") and "vs_autocast" in row:
                        checks.append(
                            {
                                "device": device,
                                "workload": "memory",
                                "what": f"{group['model']} {group['dtype']} {row['recipe']}: memory "
                                "vs torch.autocast",
                                "value": round(row["vs_autocast"], 3),
                                "target": "< 1.0",
                                "met": row["vs_autocast"] < 1.0,
                            }
                        )
        accuracy = work.get("accuracy")
        if accuracy:
            for group in accuracy["groups"]:
                for row in group["rows"][1:]:
                    checks.append(
                        {
                            "device": device,
                            "workload": "accuracy",
                            "what": f"lenet5 {group['dtype']} {row['recipe']}: test accuracy vs "
                            "float32 (points)",
                            "value": round(row["accuracy_delta_points"], 2),
                            "target": ">= -1.0",
                            "met": row["parity"],
                        }
                    )
        watch = work.get("monitor")
        if watch:
            for row in watch["rows"]:
                what = f"{row['model']} {row['dtype']}: precision monitor"
                checks.append(
                    {
                        "device": device,
                        "workload": "monitor",
                        "what": f"{what} overhead at every={row['every']} (share of step time)",
                        "value": round(row["overhead"], 4),
                        "target": "<= 0.03",
                        "met": row["meets_target"],
                    }
                )
                added = row["syncs"]["added_between_samples"]
                checks.append(
                    {
                        "device": device,
                        "workload": "monitor",
                        "what": f"{what} host syncs added per step between samples",
                        "value": added,
                        "target": "<= 0",
                        "met": added <= 0,
                    }
                )
        checks += distributed.targets(device, work.get("distributed"))
    return checks


def _loads(values: list[float] | None) -> str:
    return "-" if not values else " ".join(f"{v:.1f}" for v in values)


def _omp(env: dict[str, Any]) -> str:
    by_suite = set(env.get("omp_env_set_by_suite", []))
    parts = [
        f"{k}={v}" + (" (the suite's default)" if k in by_suite else "")
        for k, v in env.get("omp_env", {}).items()
    ]
    return ", ".join(parts) or "-"


def _machine(doc: dict[str, Any]) -> list[str]:
    env = doc["environment"]
    rows = [
        ["CPU", env["cpu_model"]],
        ["CPU features", ", ".join(env["cpu_flags"]) or "-"],
        ["logical CPUs / torch threads", f"{env['logical_cpus']} / {env['torch_threads']}"],
        [
            "load average (1/5/15 min) at start / end",
            f"{_loads(env.get('load_average_at_start'))} / {_loads(env.get('load_average_at_end'))}",
        ],
        [
            "OpenMP environment",
            _omp(env),
        ],
        ["OS", env["os"]],
        ["Python", env["python"]],
        ["torch", env["torch"]],
        ["numpy", env["numpy"]],
        [
            "mixprec",
            f"{env['mixprec']}" + (f" (commit {env['git_commit']})" if env["git_commit"] else ""),
        ],
        ["GPU", env["gpu"]["name"] if env["gpu"] else "none (CUDA not available)"],
    ]
    if env["gpu"]:
        rows.append(
            [
                "GPU memory / capability / CUDA",
                f"{env['gpu']['memory_gib']} GiB / {env['gpu']['capability']} / {env['gpu']['cuda']}",
            ]
        )
    return _table(["", ""], rows)


def _ratio_cell(phase: dict[str, Any]) -> str:
    return f"{phase['ratio']:.3f} ({phase['ratio_q1']:.2f}-{phase['ratio_q3']:.2f})"


def _overhead(section: dict[str, Any]) -> list[str]:
    rows = []
    for row in section["rows"]:
        for phase, label in (("full_step", "full step"), ("step_only", "optimizer step")):
            p = row[phase]
            rows.append(
                [
                    row["model"],
                    row["optimizer"],
                    label,
                    _ms(p["gradscaler"]["median_s"]),
                    _ms(p["mixprec"]["median_s"]),
                    _ms(p["bare"]["median_s"]),
                    _ratio_cell(p),
                    _mark(p["ratio"] <= 1.0),
                    f"{p['mixprec_overhead_us']:.0f} / {p['gradscaler_overhead_us']:.0f}",
                    f"{p['scaler_ratio']:.3f}" if "scaler_ratio" in p else "-",
                ]
            )
    lines = _table(
        [
            "model",
            "inner optimizer",
            "timed",
            "GradScaler ms",
            "mixprec ms",
            "no scaling ms",
            "mixprec / GradScaler (quartiles)",
            "<= 1.0",
            "µs above no scaling (mixprec / GradScaler)",
            "mixprec.GradScaler / GradScaler",
        ],
        rows,
    )
    wrapper_rows = section.get("wrapper_only", [])
    if wrapper_rows:
        lines += [
            "The wrappers alone (the inner optimizer's `step` does nothing; the fused API "
            "variant hands `found_inf` to it like the fused kernels):",
            "",
        ]
        table = []
        for row in wrapper_rows:
            p = row["wrapper_only"]
            table.append(
                [
                    row["model"],
                    row["tensors"],
                    row["inner"],
                    f"{1e6 * p['gradscaler']['median_s']:.0f}",
                    f"{1e6 * p['mixprec']['median_s']:.0f}",
                    f"{p['mixprec_minus_gradscaler_us']:+.0f}",
                    _ratio_cell(p),
                    _mark(p["ratio"] <= 1.0),
                ]
            )
        lines += _table(
            [
                "model",
                "tensors",
                "inner",
                "GradScaler µs",
                "mixprec µs",
                "difference µs",
                "mixprec / GradScaler (quartiles)",
                "<= 1.0",
            ],
            table,
        )
    profiled = [row for row in wrapper_rows if "profile" in row]
    if profiled:
        lines += [
            "Profiles of the wrapper-alone steps where mixprec was slower: the ops "
            "dispatched per step, then the Python functions with the most own time "
            "(cProfile, median over the profiled steps; cProfile's own cost inflates "
            "these).",
            "",
        ]
        for row in profiled:
            prof = row["profile"]
            lines.append(
                f"*{row['model']}, {row['inner']}*: dispatched ops per step: mixprec "
                f"{prof['mixprec']['aten_ops']} vs GradScaler {prof['gradscaler']['aten_ops']}; "
                f"profiled Python total {prof['mixprec']['python_total_us']:.0f} µs vs "
                f"{prof['gradscaler']['python_total_us']:.0f} µs."
            )
            lines.append("")
            for side in ("mixprec", "gradscaler"):
                ops = ", ".join(f"{o['op']} {o['calls']}" for o in prof[side]["top_ops"][:8])
                lines.append(f"- most frequent ops, {side}: {ops}")
            lines.append("")
            table = []
            for side in ("mixprec", "gradscaler"):
                for entry in prof[side]["top_functions"][:6]:
                    table.append(
                        [
                            side,
                            f"`{entry['function']}`",
                            f"{entry['calls']:.0f}",
                            f"{entry['self_us']:.0f}",
                        ]
                    )
            lines += _table(["wrapper", "function", "calls / step", "own µs / step"], table)
    return lines


def _syncs(section: dict[str, Any]) -> list[str]:
    rows = [
        [
            row["model"],
            row["optimizer"],
            row["inner"],
            row["mixprec"],
            row["gradscaler"],
            row["added"],
            row["gradscaler_added"],
            f"<= {row['target_added']}",
            _mark(row["meets_target"]),
        ]
        for row in section["rows"]
    ]
    return _table(
        [
            "model",
            "inner optimizer",
            "inner alone",
            "mixprec",
            "GradScaler",
            "added by mixprec",
            "added by GradScaler",
            "target",
            "met",
        ],
        rows,
    )


def _throughput(section: dict[str, Any]) -> list[str]:
    lines = []
    for group in section["groups"]:
        lines.append(
            f"**{group['model']}**, {group['dtype']}, batch {group['batch']}, "
            f"{group['params'] / 1e6:.2f}M parameters:"
        )
        lines.append("")
        rows = [
            [
                r["recipe"],
                _ms(r["median_s"]),
                f"{r['samples_per_s']:.1f}",
                f"{r['speedup_vs_fp32']:.2f}",
                f"{r['speedup_vs_autocast']:.2f} ({r['speedup_vs_autocast_q1']:.2f}-"
                f"{r['speedup_vs_autocast_q3']:.2f})",
            ]
            for r in group["rows"]
        ]
        lines += _table(
            [
                "recipe",
                "median step ms",
                "samples/s",
                "speed vs fp32",
                "speed vs autocast (quartiles)",
            ],
            rows,
        )
    return lines


def _memory(section: dict[str, Any]) -> list[str]:
    lines = []
    for group in section["groups"]:
        measure = group["rows"][0]["measure"]
        lines.append(f"**{group['model']}**, {group['dtype']} ({measure}, MiB):")
        lines.append("")
        rows = [
            [
                r["recipe"],
                f"{r['peak_mib']:.0f}",
                f"{r['above_baseline_mib']:.1f}",
                f"{r['vs_autocast']:.2f}" if "vs_autocast" in r else "-",
            ]
            for r in group["rows"]
        ]
        lines += _table(["recipe", "peak", "above baseline", "vs autocast"], rows)
    return lines


def _accuracy(section: dict[str, Any]) -> list[str]:
    lines = []
    for group in section["groups"]:
        lines.append(
            f"**LeNet-5 on digits**, {group['dtype']}, {group['epochs']} epochs, batch "
            f"{group['batch']}, seeds {', '.join(str(s) for s in group['seeds'])}:"
        )
        lines.append("")
        rows = [
            [
                r["recipe"],
                r["steps"],
                f"{100 * r['test_accuracy']:.2f}",
                " / ".join(f"{100 * a:.1f}" for a in r["test_accuracy_per_seed"]),
                f"{r['accuracy_delta_points']:+.2f}",
                f"{r['test_loss']:.4f}",
                f"{r['loss_delta']:+.4f}",
                _mark(r["parity"]),
            ]
            for r in group["rows"]
        ]
        lines += _table(
            [
                "recipe",
                "steps",
                "test acc %",
                "per seed",
                "Δ points",
                "test loss",
                "Δ loss",
                "parity",
            ],
            rows,
        )
    return lines


def _mfu(section: dict[str, Any]) -> list[str]:
    rates = ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in section["matmul_tflops"].items())
    lines = [
        f"Measured {section['matmul_n']}x{section['matmul_n']} matmul: {rates}. Transformer "
        f"step (forward + backward): {section['transformer_step_gflop']:.3g} GFLOP.",
        "",
    ]
    if section["rows"]:
        rows = [
            [
                r["dtype"],
                r["recipe"],
                f"{r['achieved_tflops']:.3g}",
                f"{100 * r['mfu']:.1f}",
            ]
            for r in section["rows"]
        ]
        header = f"MFU % of {section['mfu_reference']}"
        lines += _table(["dtype", "recipe", "achieved TFLOP/s", header], rows)
    return lines


def _monitor(section: dict[str, Any]) -> list[str]:
    rows = []
    for r in section["rows"]:
        t, syncs = r["times"], r["syncs"]
        rows.append(
            [
                r["model"],
                r["dtype"],
                r["tensors"],
                _ms(t["bare"]["median_s"]),
                _ms(t["monitored"]["median_s"]),
                f"{r['between_samples_ratio']:.3f} ({r['between_samples_q1']:.2f}-"
                f"{r['between_samples_q3']:.2f})",
                _ms(r["sample_extra_s"]),
                f"{100 * r['overhead']:.2f}%",
                _mark(r["meets_target"]),
                f"{100 * r['unnamed_overhead']:.2f}%",
                f"{syncs['added_between_samples']} / {syncs['added_sampled']} / "
                f"{syncs['read_sample']}",
            ]
        )
    return _table(
        [
            "model",
            "dtype",
            "tensors",
            "bare ms",
            "monitored ms",
            "between samples: monitored / bare (quartiles)",
            "sampled step: extra ms",
            f"overhead at every={section['rows'][0]['every'] if section['rows'] else '-'}",
            "<= 3 %",
            "overhead, name_overflows=False",
            "syncs added: between / sampled step / reading a sample",
        ],
        rows,
    )


_SECTIONS = (
    ("overhead", "1. Loss-scaling overhead: LossScaleOptimizer vs torch.amp.GradScaler", _overhead),
    ("host_syncs", "2. Host syncs per optimizer step", _syncs),
    ("throughput", "3. Training throughput", _throughput),
    ("memory", "4. Peak memory", _memory),
    ("accuracy", "5. Accuracy parity", _accuracy),
    ("mfu", "6. Model FLOP utilisation", _mfu),
    ("monitor", "7. Precision-monitor overhead (GradientMonitor, default interval)", _monitor),
    ("distributed", "8. Ranks that agree: DDP x2, found-inf all-reduce", distributed.render),
)

_METHOD = """\
How the numbers are taken:

- `python -m benchmarks` runs with `OMP_WAIT_POLICY=PASSIVE` unless the
  variable is set (machine table): with OpenMP's default busy-waiting, worker
  threads that share their cores with other jobs stall every parallel region,
  and step times then vary tenfold.
- Every comparison runs all its configurations in one process and one loop,
  one step each per round, the order reversed every other round; times are
  medians over the timed rounds after untimed warm-up rounds, and a ratio is the
  median of the per-round ratios. Shared or noisy machines move the absolute
  times; the ratios are what to read.
- Loss-scaling overhead: `GradScaler` = `scaler.scale(loss).backward();
  scaler.step(opt); scaler.update()`, mixprec = `opt.scale_loss(loss).backward();
  opt.step()`, both from a scale of 2**15; "no scaling" is the bare inner
  optimizer, the floor. "optimizer step" times the step alone on gradients
  refilled (untimed) with the same scaled values each round. Forward passes
  are float32 on a CPU, float16 autocast on a GPU. "The wrappers alone" wrap an
  inner optimizer whose step does nothing: what is left is each wrapper's own
  work (unscale and check, scale update, bookkeeping); the tiny model shows the
  fixed cost per step. Where mixprec is slower there, the step is profiled.
- Host syncs are counted with `mixprec.tools._syncs.HostSyncCounter` on one
  steady-state step: scalar reads and device-to-host copies. Adam without
  `capturable` reads its CPU step counters with `.item()` (no device sync on a
  GPU), so "inner alone" is listed and "added" is what the wrapper costs.
- Recipes: `fp32`; `autocast` (`torch.autocast`, plain backward, PyTorch's
  bfloat16 recipe); `autocast+gradscaler` (PyTorch's float16 recipe, kept for
  bfloat16 as the usual copy-paste recipe); `O1`-`O3` (`mixprec.amp.initialize`);
  `rewrite` (`mixprec.rewrite.rewrite` + `LossScaleOptimizer`). All use
  AdamW (fused where available), the same initial weights, float32 loss; loss
  scaling is dynamic for float16 and off for bfloat16.
- CPU runs use bfloat16 only: float16 matrix products have no hardware units on
  CPUs and run slower than float32, so they say nothing about mixed precision.
- Peak memory: each configuration in its own process. CPU: the resident-set
  high-water mark (`VmHWM`, the figure `ru_maxrss` reports, read per address
  space because a child's `ru_maxrss` also carries the RSS of the parent it was
  forked from), reset to the current RSS at a baseline taken after the imports
  and a tiny warm-up step of the same architecture; "above baseline" is what
  training needed. GPU: `torch.cuda.max_memory_allocated`.
- Accuracy: LeNet-5 on the embedded digits, AdamW lr 1e-2 decaying linearly to
  0, mean over seeds; parity = mean test accuracy at most 1 point below float32.
- Precision monitor: the `O2` recipe bare, with `GradientMonitor(every=100)`, with
  `name_overflows=False`, and with `every=1` (every step samples and reads the sample
  back), interleaved; overhead at the default interval = (monitored / bare - 1) +
  (sampled-step extra time / 100) / bare step time.
"""


def render_markdown(doc: dict[str, Any]) -> str:
    """The whole report: command, machine, targets, one section per workload and device."""
    env = doc["environment"]
    commit = env.get("git_commit") or "unknown"
    lines = [
        "# Benchmarks",
        "",
        f"Measured at commit {commit} (mixprec {env['mixprec']}) on {doc['started']}, on "
        f"{env['cpu_model']} ({env['logical_cpus']} logical CPUs; CPU features: "
        f"{', '.join(env['cpu_flags']) or 'none of note'}). Produced by `{doc['command']}` "
        f"({doc['preset']} suite, {doc['duration_s']:.0f} s); the same run wrote "
        "`results.json` with every sample. Everything above the sections headed "
        '"Earlier measurements" is this run\'s; each section below them says when, at which '
        "commit and on which machine it was measured.",
        "",
        "## Machine",
        "",
    ]
    lines += _machine(doc)
    lines += ["## Targets", ""]
    checks = doc["targets"]
    met = sum(1 for c in checks if c["met"])
    lines.append(f"{met} of {len(checks)} targets met.")
    lines.append("")
    lines += _table(
        ["device", "workload", "measured", "value", "target", "met"],
        [
            [c["device"], c["workload"], c["what"], c["value"], c["target"], _mark(c["met"])]
            for c in checks
        ],
    )
    for note in doc.get("notes", []):
        lines += [f"> {note}", ""]
    lines += ["## Method", "", _METHOD]
    for device, work in doc["results"].items():
        for key, title, render in _SECTIONS:
            section = work.get(key)
            if section is None:
                continue
            lines += [f"## {title} ({device})", ""]
            if "error" in section:
                lines += [f"Failed: `{section['error']}`", ""]
                continue
            lines += render(section)
    return "\n".join(lines).rstrip() + "\n"
