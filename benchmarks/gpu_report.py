"""Ratios, targets and the Markdown section of :mod:`benchmarks.gpu`'s results.

Ratios (added to each measured row by :func:`annotate`)::

    speed_vs_autocast          = t(autocast bf16, eager)    / t(recipe)    > 1: faster
    speed_vs_compile_autocast  = t(compile(autocast bf16))  / t(recipe)
    memory_vs_autocast         = m(recipe) / m(autocast bf16, eager)       < 1: smaller

with ``t`` the median step time and ``m`` the peak allocated memory above what was
allocated before the recipe was built. Targets compare each mixprec recipe with
torch's recipe of the same precision and mode: bfloat16 with ``autocast``, float16
with ``autocast+gradscaler``, eager with eager and compiled with compiled.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MIXPREC_RECIPES", "annotate", "check_targets", "render_markdown"]

#: The recipes that are mixprec's (the rest are torch's own, the anchors).
MIXPREC_RECIPES = (
    "O1", "O2", "O3", "rewrite", "autocast+mixprec.GradScaler", "O2+fp8", "O2+fp8-rowwise",
    "lean",
)  # fmt: skip
#: mixprec's compiled float8 recipes and torchao's they must match in speed.
FLOAT8_PEERS = (("O2+fp8", "torchao-fp8-tensorwise"), ("O2+fp8-rowwise", "torchao-fp8-rowwise"))
MFU_AIM = 0.5
NA_CPU = "n/a on CPU"


def _ok(rows: list[dict[str, Any]], recipe: str, dtype: str, mode: str) -> dict[str, Any] | None:
    for row in rows:
        if (row["recipe"], row["dtype"], row["mode"], row.get("status")) == (
            recipe, dtype, mode, "ok"
        ):  # fmt: skip
            return row
    return None


def _anchor(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """torch's recipe of ``row``'s precision and mode."""
    recipe = "autocast+gradscaler" if row["dtype"] == "float16" else "autocast"
    return _ok(rows, recipe, row["dtype"], row["mode"])


def _speed(anchor: dict[str, Any] | None, row: dict[str, Any]) -> float | None:
    return None if anchor is None else anchor["median_s"] / row["median_s"]


def _memory(row: dict[str, Any], anchor: dict[str, Any] | None) -> float | None:
    if anchor is None or row.get("above_baseline_mib") is None:
        return None
    return row["above_baseline_mib"] / anchor["above_baseline_mib"]


def annotate(doc: dict[str, Any]) -> None:
    """Add the ratios to every measured row and the targets to ``doc`` (in place)."""
    rows = doc["rows"]
    eager = _ok(rows, "autocast", "bfloat16", "eager")
    compiled = _ok(rows, "autocast", "bfloat16", "compiled")
    for row in rows:
        if row.get("status") != "ok":
            continue
        row["speed_vs_autocast"] = _speed(eager, row)
        row["speed_vs_compile_autocast"] = _speed(compiled, row)
        row["memory_vs_autocast"] = _memory(row, eager)
    doc["targets"] = check_targets(rows)


def _target(text: str, met: bool | None, value: str) -> dict[str, Any]:
    return {"target": text, "met": met, "value": value}


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU targets, each ``met`` True/False, or None where a number is missing."""
    targets = []
    mine = [r for r in rows if r.get("status") == "ok" and r["recipe"] in MIXPREC_RECIPES]
    for row in mine:
        anchor = _anchor(rows, row)
        speed, memory = _speed(anchor, row), _memory(row, anchor)
        name = anchor["label"] if anchor else "its anchor (not measured)"
        text = f"{row['label']} >= 1.0x {name} step time at <= its memory"
        if speed is None:
            targets.append(_target(text, None, "anchor not measured"))
            continue
        # Too slow is a miss on its own; fast enough needs the memory to decide.
        met = False if speed < 1.0 else (None if memory is None else memory <= 1.0)
        shown = f"speed {speed:.3f}x, memory " + (NA_CPU if memory is None else f"{memory:.3f}x")
        targets.append(_target(text, met, shown))
    for row in (r for r in mine if r["recipe"] == "lean" and r["mode"] == "eager"):
        anchor = _anchor(rows, row)
        speed, memory = _speed(anchor, row), _memory(row, anchor)
        text = f"{row['label']} >= 1.1x autocast bf16's speed at <= 0.6x its peak memory"
        if speed is None or memory is None:
            targets.append(_target(text, None, "anchor or memory not measured"))
        else:
            met = speed >= 1.1 and memory <= 0.6
            targets.append(_target(text, met, f"speed {speed:.3f}x, memory {memory:.3f}x"))
    for row in (r for r in mine if r["recipe"] == "O2"):
        anchor = _anchor(rows, row)
        memory = _memory(row, anchor)
        text = f"{row['label']} memory < {anchor['label'] if anchor else 'its anchor'}'s"
        shown = NA_CPU if row.get("above_baseline_mib") is None else (
            "anchor not measured" if memory is None else f"{memory:.3f}x"
        )  # fmt: skip
        targets.append(_target(text, None if memory is None else memory < 1.0, shown))
    anchor = _ok(rows, "autocast", "bfloat16", "compiled")
    compiled = [r for r in mine if r["mode"] == "compiled"]
    text = "best compiled mixprec recipe >= 1.05x compile(autocast bf16)"
    if anchor is None or not compiled:
        targets.append(_target(text, None, "not measured"))
    else:
        best = min(compiled, key=lambda r: r["median_s"])
        speed = anchor["median_s"] / best["median_s"]
        targets.append(_target(text, speed >= 1.05, f"{best['label']}: {speed:.3f}x"))
    fp8 = next((r for r in compiled if r["recipe"] == "O2+fp8"), None)
    text = "compile(O2+fp8 bf16) >= 1.2x compile(autocast bf16) (float8 target)"
    if anchor is None or fp8 is None:
        targets.append(_target(text, None, "not measured"))
    else:
        speed = anchor["median_s"] / fp8["median_s"]
        targets.append(_target(text, speed >= 1.2, f"{speed:.3f}x"))
    for ours, theirs in FLOAT8_PEERS:
        text = f"compile({ours} bf16) >= compile({theirs} bf16) (float8 at torchao's speed)"
        mine_row = _ok(rows, ours, "bfloat16", "compiled")
        peer_row = _ok(rows, theirs, "bfloat16", "compiled")
        if mine_row is None or peer_row is None:
            targets.append(_target(text, None, "not measured"))
        else:
            speed = peer_row["median_s"] / mine_row["median_s"]
            targets.append(_target(text, speed >= 1.0, f"{speed:.3f}x"))
    measured = [r for r in rows if r.get("status") == "ok"]
    text = f"MFU >= {MFU_AIM:.0%} of the measured bf16 matmul rate (aim)"
    if measured:
        best = max(measured, key=lambda r: r["mfu"])
        targets.append(_target(text, best["mfu"] >= MFU_AIM, f"{best['label']}: {best['mfu']:.1%}"))
    else:
        targets.append(_target(text, None, "not measured"))
    return targets


def _flop(value: float) -> str:
    """``8.67 TFLOP``, ``3.81 MFLOP``: three significant digits in the unit that fits."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} FLOP"


def _num(value: Any, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| recipe | step ms | tokens/s | TFLOP/s | MFU | peak MiB | speed vs autocast "
        "| speed vs compile(autocast) | memory vs autocast | B/param kept | final loss | notes |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in doc["rows"]:
        if row.get("status") != "ok":
            error = str(row.get("error", "did not finish")).replace("|", "/")
            lines.append("| " + " | ".join([row["label"], f"failed: {error}"] + [""] * 10) + " |")
            continue
        notes = []
        if not row["params_updated"]:
            notes.append("weights never moved")
        if row.get("skipped_steps"):
            notes.append(f"{row['skipped_steps']} steps skipped (overflow)")
        if "dynamo" in row:
            d = row["dynamo"]
            notes.append(f"{d['graphs']} graphs, {d['graph_breaks']} breaks, {d['frames']} frames")
            notes.append(f"compile {row['warmup_s'][0]:.0f} s")
        cells = [
            row["label"],
            f"{row['median_s'] * 1e3:.1f}",
            f"{row['tokens_per_s']:,.0f}",
            f"{row['achieved_tflops']:.1f}",
            f"{row['mfu']:.1%}",
            _num(row.get("above_baseline_mib"), ",.0f", NA_CPU),
            _num(row.get("speed_vs_autocast"), ".3f"),
            _num(row.get("speed_vs_compile_autocast"), ".3f"),
            _num(row.get("memory_vs_autocast"), ".3f", NA_CPU),
            _num(row.get("resident_bytes_per_param"), ".2f", NA_CPU),
            f"{row['final_loss']:.4f}" if row["loss_finite"] else f"**{row['final_loss']}**",
            "; ".join(notes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _setup(doc: dict[str, Any]) -> list[str]:
    env, size = doc["environment"], doc["size"]
    versions = [f"torch {env['torch']}", f"Python {env['python']}", f"mixprec {env['mixprec']}"]
    if doc["device"] == "cuda":
        gpu = env.get("gpu") or {}
        versions[1:1] = [
            f"CUDA {gpu.get('cuda')}",
            f"driver {env.get('driver')}",
            f"cuDNN {env.get('cudnn')}",
            f"Triton {env.get('triton')}",
        ]
    lines = [
        f"- Device: {doc['device_name']} ({doc['device']}); {', '.join(versions)}; "
        f"commit {env.get('git_commit')}; {doc['started']}.",
        f"- Command: `{doc['command']}`",
        f"- Model: TransformerClassifier, d_model {size['d_model']}, {size['num_layers']} layers, "
        f"{size['nhead']} heads, feed-forward {size['dim_feedforward']}, sequence "
        f"{size['seq_len']} x {size['token_dim']} features, batch {size['batch']}, no dropout; "
        "AdamW(fused=True), float32 cross-entropy loss.",
    ]
    flops = doc.get("flops")
    if flops:
        counted = flops.get("counted_by_FlopCounterMode")
        check = f" (FlopCounterMode counts {_flop(counted)})" if counted else ""
        lines.append(
            f"- FLOPs a step = 6·N·T + 12·L·T·s·d with N = {flops['N_params_in_matmuls']:,} "
            f"parameters (all but the position embedding), T = {flops['T_tokens']:,} tokens, "
            f"L layers, s sequence, d d_model: {_flop(flops['per_step'])}{check}."
        )
    matmul = doc.get("matmul")
    if matmul:
        rates = ", ".join(f"{k} {v:.1f}" for k, v in matmul["tflops"].items())
        lines.append(
            f"- Matmul rates, {matmul['n']}^3 ({matmul['method']}): {rates} TFLOP/s. "
            "MFU = FLOPs a step / median step time / the bfloat16 rate."
        )
    memory = (
        "torch.cuda.max_memory_allocated, reset per recipe, above what was allocated before "
        "the recipe was built"
        if doc["device"] == "cuda"
        else NA_CPU
    )
    lines.append(
        f"- Timing: median of {size['steps']} steps ({doc['timing']['clock']}) after warm-up "
        f"({doc['timing']['warmup']}). Peak memory: {memory}. B/param kept: what stays "
        "allocated between steps (weights, master copies, optimizer state; gradients "
        "freed) per model parameter. Final loss: the last timed step's, on the fixed batch."
    )
    return lines


def _checks(doc: dict[str, Any]) -> list[str]:
    lines = []
    syncs = doc["checks"].get("host_syncs")
    if syncs and "error" in syncs:
        lines.append(f"- Host-sync check failed to run: {syncs['error']}")
    elif syncs:
        parts = []
        for scope in ("whole step", "optimizer step"):
            result = syncs[scope]
            parts.append(
                f"{scope}: " + ("pass" if result["passed"] else f"FAIL ({result['error']})")
            )
        lines.append(
            f"- Host syncs, {syncs['recipe']}, {syncs['steps']} steps after {syncs['warmup']} "
            f"under {syncs['mode']}: {'; '.join(parts)}."
        )
    profile = doc["checks"].get("profile")
    if profile and "error" in profile:
        lines.append(f"- Kernel profile failed to run: {profile['error']}")
    elif profile:
        lines += [
            "",
            f"Top {len(profile['top'])} of {profile['recipe']} ({profile['time']}, "
            f"{profile['total_ms_per_step']:.1f} ms a step in all):",
            "",
            f"| {'kernel' if doc['device'] == 'cuda' else 'operator'} | ms/step | share "
            "| calls/step |",
            "|---|--:|--:|--:|",
        ]
        for k in profile["top"]:
            name = k["name"].replace("|", "/")
            name = name if len(name) <= 80 else name[:77] + "..."
            lines.append(
                f"| `{name}` | {k['ms_per_step']:.2f} | {k['share']:.1%} | "
                f"{k['calls_per_step']:g} |"
            )
    return lines


def render_markdown(doc: dict[str, Any]) -> str:
    """The GPU section for BENCHMARKS.md: setup, table, targets, failures, checks, profile."""
    out = [f"## GPU benchmark: {doc['device_name']}", ""]
    if doc.get("partial"):
        why = doc.get("interrupted") or "still running"
        out += [f"**Partial results** ({why}).", ""]
    out += _setup(doc) + [""] + _table(doc) + [""]
    by_reason: dict[str, list[str]] = {}
    for skipped in doc["skipped"]:
        by_reason.setdefault(skipped["reason"], []).append(skipped["label"])
    for reason, labels in by_reason.items():
        out += [f"Not run ({reason}): {', '.join(labels)}.", ""]
    out += ["Targets:", ""]
    for t in doc.get("targets", []):
        mark = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        out.append(f"- {mark}: {t['target']} ({t['value']})")
    out += [""] + _checks(doc)
    return "\n".join(out).rstrip() + "\n"
