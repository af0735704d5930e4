"""Smoke test of the benchmark suite: it runs end to end and its output is well formed.

``--smoke`` runs every workload at tiny sizes (half a minute on 2 cores with bfloat16
units, one to two minutes without: bfloat16 is emulated there), so it is marked slow
with the full ``--quick`` run. Only the shape of the output is checked
here, never the speed: timings on a shared test machine say nothing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "overhead",
    "host_syncs",
    "throughput",
    "memory",
    "accuracy",
    "mfu",
    "distributed",
    "monitor",
}
RECIPES = ["fp32", "autocast", "autocast+gradscaler", "O1", "O2", "O3", "rewrite"]


def _run_suite(out: Path, *flags: str, timeout: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            *flags,
            "--out",
            str(out),
            "--markdown",
            str(out / "B.md"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text(encoding="utf-8"))


def _positive(value: object, where: str) -> None:
    assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    assert math.isfinite(value) and value > 0, f"{where} = {value!r}"


def _check_document(doc: dict, out: Path, preset: str) -> None:
    assert doc["preset"] == preset
    assert "python -m benchmarks" in doc["command"]
    env = doc["environment"]
    for key in ("cpu_model", "logical_cpus", "torch", "python", "mixprec"):
        assert env[key], key
    assert "cpu" in doc["devices"]
    if "cuda" not in doc["devices"]:
        assert any("No CUDA device" in note for note in doc["notes"])
    work = doc["results"]["cpu"]
    assert set(work) == WORKLOADS
    for name, section in work.items():
        assert "error" not in section, f"{name}: {section.get('error')}"

    for row in work["overhead"]["rows"]:
        for phase in ("full_step", "step_only"):
            for variant in ("gradscaler", "mixprec", "bare"):
                stats = row[phase][variant]
                assert stats["n"] >= 5
                _positive(stats["median_s"], f"{row['model']} {row['optimizer']} {phase} {variant}")
            _positive(row[phase]["ratio"], f"{row['model']} {row['optimizer']} {phase} ratio")
    assert {r["optimizer"] for r in work["overhead"]["rows"]} >= {
        "sgd",
        "adam-foreach",
        "adam-fused",
    }

    for row in work["host_syncs"]["rows"]:
        for key in ("mixprec", "gradscaler", "inner", "added"):
            assert isinstance(row[key], int) and row[key] >= 0, (row["optimizer"], key)
        # Counting is exact and machine-independent: the wrapper's own syncs are fixed.
        assert row["added"] == (0 if "fused" in row["optimizer"] else 1), row

    for group in work["throughput"]["groups"]:
        assert [r["recipe"] for r in group["rows"]] == RECIPES
        for r in group["rows"]:
            for key in ("median_s", "samples_per_s", "speedup_vs_fp32", "speedup_vs_autocast"):
                _positive(r[key], f"throughput {group['model']} {r['recipe']} {key}")
    assert {g["model"] for g in work["throughput"]["groups"]} == {"transformer", "lenet5"}

    for group in work["memory"]["groups"]:
        for r in group["rows"]:
            _positive(r["peak_mib"], f"memory {r['recipe']} peak")
            assert r["above_baseline_mib"] >= 0

    for group in work["accuracy"]["groups"]:
        assert [r["recipe"] for r in group["rows"]] == RECIPES
        for r in group["rows"]:
            assert 0.0 <= r["test_accuracy"] <= 1.0
            _positive(r["test_loss"], f"accuracy {r['recipe']} loss")
        assert group["rows"][0]["accuracy_delta_points"] == 0.0

    mfu = work["mfu"]
    for rate in mfu["matmul_tflops"].values():
        _positive(rate, "matmul rate")
    _positive(mfu["transformer_step_gflop"], "step GFLOP")
    assert {r["recipe"] for r in mfu["rows"]} == set(RECIPES)

    assert doc["targets"] and all(isinstance(c["met"], bool) for c in doc["targets"])
    markdown = (out / "results.md").read_text(encoding="utf-8")
    assert markdown == (out / "B.md").read_text(encoding="utf-8")
    assert markdown.startswith("# Benchmarks")
    assert "| recipe | median step ms | samples/s |" in markdown
    assert "|---|" in markdown
    for heading in (
        "## Machine",
        "## Targets",
        "Loss-scaling overhead",
        "Host syncs",
        "Peak memory",
    ):
        assert heading in markdown


MARKER = "<!-- analysis: kept when the report is regenerated -->"


@pytest.mark.slow
def test_smoke_suite_output_is_well_formed(tmp_path):
    # A published report's hand-written analysis survives regeneration; the rest is replaced.
    (tmp_path / "B.md").write_text(
        f"# Old numbers\n\n{MARKER}\n## Analysis\nkept\n", encoding="utf-8"
    )
    doc = _run_suite(tmp_path, "--smoke", "--threads", "1", timeout=300)
    published = (tmp_path / "B.md").read_text(encoding="utf-8")
    assert "# Old numbers" not in published
    assert published.endswith(f"{MARKER}\n## Analysis\nkept\n")
    (tmp_path / "B.md").write_text(published.split(MARKER)[0].rstrip("\n") + "\n", encoding="utf-8")
    _check_document(doc, tmp_path, "smoke")


@pytest.mark.slow
def test_quick_suite_output_is_well_formed(tmp_path):
    doc = _run_suite(tmp_path, "--quick", timeout=600)
    _check_document(doc, tmp_path, "quick")


def test_bad_arguments_are_rejected():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "nonsense"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown workload" in proc.stderr


@pytest.mark.slow
def test_compiled_benchmark_smoke_output_is_well_formed(capsys):
    """``python -m benchmarks.compiled --smoke``: every recipe timed for both models, both
    targets checked per model (about a minute: six models compile per workload)."""
    from benchmarks import compiled

    compiled.main(["--smoke"])
    text = capsys.readouterr().out
    for recipe in ("autocast", "compile(autocast)", "compile(O1)", "compile(rewrite)"):
        assert f"| {recipe} |" in text, recipe
    assert text.count("\n| compile(autocast) |") == 2  # one row per model
    assert text.count("| transformer |") == text.count("| lenet5 |") == 2  # two targets each
