"""The GPU benchmark (``python -m benchmarks.gpu``) on a CPU at tiny sizes.

The script is meant for one long run on a GPU; these tests make sure it runs end to
end (both runs that start the benchmark are marked slow), writes well-formed results,
keeps to its time budget, survives SIGINT, and judges its targets right. Only the shape of the output is checked, never speed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402
from benchmarks.gpu_measure import SIZES, Workload, step_flops  # noqa: E402
from benchmarks.gpu_report import check_targets  # noqa: E402

EAGER = [
    "autocast bf16",
    "fp32",
    "O2 bf16",
    "O1 bf16",
    "O3 bf16",
    "rewrite bf16",
    "autocast+gradscaler fp16",
    "autocast+mixprec.GradScaler fp16",
    "O2 fp16",
    "O2+fp8 bf16",
    "O2+fp8-rowwise bf16",
    "lean bf16",
]
# Compiled, the recipes the targets judge lead; float32 goes last.
COMPILED = [
    f"compile({label})"
    for label in (
        "autocast bf16", "O2 bf16", "O2+fp8 bf16", "O2+fp8-rowwise bf16", "lean bf16",
        "O3 bf16", "O1 bf16",
        "rewrite bf16", "autocast+gradscaler fp16", "autocast+mixprec.GradScaler fp16",
        "O2 fp16", "fp32",
    )
]  # fmt: skip
PEERS = ["flashoptim bf16", "flashoptim32 bf16", "torchao-fp8-tensorwise bf16",
         "torchao-fp8-rowwise bf16"]  # fmt: skip


def _command(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu", "--out", str(out), "--device", "cpu", *flags]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return env


def _positive(value: object, where: str) -> None:
    assert isinstance(value, int | float) and not isinstance(value, bool), where
    assert math.isfinite(value) and value > 0, f"{where} = {value!r}"


@pytest.mark.slow  # 6-12 s on 2 busy cores: nine recipes, two checks, a profile
def test_smoke_run_writes_well_formed_results(tmp_path):
    proc = subprocess.run(
        _command(tmp_path, "--size", "smoke", "--budget-s", "60", "--no-compile"),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_results.json").read_text(encoding="utf-8"))
    assert doc["partial"] is False and doc["interrupted"] is None
    assert doc["device"] == "cpu" and doc["command"].startswith("python -m benchmarks.gpu --out")
    assert doc["size"]["name"] == "smoke" and doc["environment"]["torch"] == torch.__version__
    assert set(doc["matmul"]["tflops"]) == {"bfloat16", "float32"}
    _positive(doc["flops"]["per_step"], "flops")
    # Every eager recipe ran, in priority order, trained (finite loss, weights moved) ...
    assert [r["label"] for r in doc["rows"]] == EAGER
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        for key in ("median_s", "tokens_per_s", "mfu", "speed_vs_autocast"):
            _positive(row[key], f"{row['label']} {key}")
        assert row["n"] == SIZES["smoke"].steps and row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["loss_finite"] and row["params_updated"], row
        assert row["peak_mib"] is None and row["memory_vs_autocast"] is None  # CUDA only
    assert doc["rows"][0]["speed_vs_autocast"] == 1.0
    # ... and every compiled one is accounted for as not run.
    assert [s["reason"] for s in doc["skipped"]] == ["--no-compile"] * len(EAGER)
    assert [s["label"] for s in doc["skipped"]] == COMPILED
    # The checks: no host sync in an O2 float16 step with fused AdamW; a top-10 profile.
    syncs = doc["checks"]["host_syncs"]
    assert syncs["whole step"] == {"passed": True, "error": None}
    assert syncs["optimizer step"] == {"passed": True, "error": None}
    top = doc["checks"]["profile"]["top"]
    assert len(top) == 10 and 0 < sum(k["share"] for k in top) <= 1.0 + 1e-9
    assert [k["ms_per_step"] for k in top] == sorted((k["ms_per_step"] for k in top), reverse=True)
    assert all(t["met"] in (True, False, None) for t in doc["targets"])
    markdown = (tmp_path / "gpu_results.md").read_text(encoding="utf-8")
    assert "| recipe | step ms |" in markdown and all(f"| {label} |" in markdown for label in EAGER)
    assert proc.stdout.strip() == markdown.strip()  # the section is printed, nothing else


@pytest.mark.slow  # a fresh Python with torch, timing matmuls before the first recipe
def test_sigint_stops_the_run_and_keeps_the_results(tmp_path):
    """SIGINT inside the first recipe's endless timing. The point is found by reading the
    benchmark's own progress (its ``[  t s] autocast bf16 ...`` line, written as the
    recipe starts), not by guessing how long start-up takes: a loaded machine only
    makes it slower."""
    results = tmp_path / "gpu_results.json"
    proc = subprocess.Popen(
        _command(tmp_path, "--size", "smoke", "--no-compile", "--steps", "10000000"),
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: list[str] = []
    started = threading.Event()

    def read_stderr() -> None:  # drained all along, so the child never blocks on a full pipe
        for line in proc.stderr:
            seen.append(line)
            if line.rstrip().endswith("] autocast bf16 ..."):
                started.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not started.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
            pass
        assert started.is_set(), "".join(seen)[-3000:]
        # The line is written just before the recipe's code runs; a moment more puts the
        # few statements between them behind us (later is as good: the timing is endless).
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout = proc.stdout.read()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)
    stderr = "".join(seen)
    assert proc.returncode == 1, stderr[-3000:]
    doc = json.loads(results.read_text(encoding="utf-8"))
    assert doc["partial"] is True and "SIGINT during autocast bf16" in doc["interrupted"]
    assert doc["rows"] == [
        {
            "label": "autocast bf16",
            "recipe": "autocast",
            "dtype": "bfloat16",
            "mode": "eager",
            "status": "failed",
            "error": "stopped by SIGINT",
        }
    ]
    not_run = [s["label"] for s in doc["skipped"]]
    assert not_run[: len(EAGER) - 1] == EAGER[1:] and "kernel profile" in not_run
    assert "**Partial results**" in stdout


def test_budget_skips_what_would_not_fit():
    budget = gpu.Budget(10.0)
    assert budget.estimate("eager") == 0.0  # nothing known: the first one may start
    budget.record("eager", 2.0)
    budget.record("eager", 3.0)
    assert budget.estimate("eager") == 3.0 and budget.estimate("check") == 3.0
    assert budget.estimate("compiled") == 30.0 + 3 * 3.0  # before the first compile
    budget.record("compiled", 12.0)
    assert budget.estimate("compiled") == 12.0
    assert budget.hard_deadline == 30.0 and gpu.Budget(400.0).hard_deadline == 440.0
    assert [j.label for j in gpu.plan_jobs(compile_too=True)] == EAGER + COMPILED
    with_peers = [j.label for j in gpu.plan_jobs(compile_too=True, peers=True)]
    assert with_peers[: len(EAGER) + len(PEERS)] == EAGER + PEERS
    compiled = with_peers[len(EAGER) + len(PEERS) :]
    assert compiled[2:6] == ["compile(O2+fp8 bf16)", "compile(torchao-fp8-tensorwise bf16)",
                             "compile(O2+fp8-rowwise bf16)", "compile(torchao-fp8-rowwise bf16)"]
    assert compiled[-1] == "compile(fp32)" and len(compiled) == len(COMPILED) + len(PEERS)


def test_only_selects_jobs_by_label_and_refuses_an_unknown_one(tmp_path, capsys):
    jobs = gpu.plan_jobs(compile_too=True, peers=True)
    chosen = gpu.select_jobs(jobs, "compile(lean bf16), autocast bf16")
    assert [j.label for j in chosen] == ["autocast bf16", "compile(lean bf16)"]  # plan order
    assert gpu.select_jobs(jobs, None) == jobs
    with pytest.raises(ValueError, match=r"no recipe labelled \['lean fp32'\]"):
        gpu.select_jobs(jobs, "lean fp32")
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--out", str(tmp_path / "out"), "--only", "O9 bf16"])
    assert stop.value.code == 2 and "--only 'O9 bf16'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget-s", "0"], "--budget-s must be a positive number of seconds, got 0.0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--out", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()  # a rejected command writes nothing


def test_step_flops_formula_matches_the_flop_counter():
    mid = dataclasses.replace(
        SIZES["smoke"], d_model=256, nhead=4, dim_feedforward=1024, seq_len=128, token_dim=64
    )
    flops = step_flops(Workload.make(mid, "cpu"))
    # 6NT counts biases and norm weights as products; at d=256 they are under 1 %.
    assert flops["per_step"] == pytest.approx(flops["counted_by_FlopCounterMode"], rel=0.01)
    assert flops["N_params_in_matmuls"] == flops["params_total"] - 128 * 256  # minus positions


def _row(label, recipe, dtype, mode, median_s, mib, mfu=0.3):
    return {"label": label, "recipe": recipe, "dtype": dtype, "mode": mode, "status": "ok",
            "median_s": median_s, "above_baseline_mib": mib, "mfu": mfu}  # fmt: skip


def test_targets_compare_each_mixprec_recipe_with_torch_of_the_same_precision_and_mode():
    rows = [
        _row("autocast bf16", "autocast", "bfloat16", "eager", 1.0, 100.0),
        _row("O2 bf16", "O2", "bfloat16", "eager", 0.9, 80.0, mfu=0.55),
        _row("O1 bf16", "O1", "bfloat16", "eager", 1.1, 90.0),  # slower: missed
        _row("O3 bf16", "O3", "bfloat16", "eager", 0.95, 101.0),  # faster, bigger: missed
        _row("lean bf16", "lean", "bfloat16", "eager", 0.9, 61.0),  # fast, memory 0.61x: missed
        _row("autocast+gradscaler fp16", "autocast+gradscaler", "float16", "eager", 2.0, 100.0),
        _row("O2 fp16", "O2", "float16", "eager", 1.5, 120.0),  # beats fp16 torch, not bf16
        _row("compile(autocast bf16)", "autocast", "bfloat16", "compiled", 0.8, 100.0),
        _row("compile(O2 bf16)", "O2", "bfloat16", "compiled", 0.85, 70.0),
        _row("compile(O2+fp8 bf16)", "O2+fp8", "bfloat16", "compiled", 0.9, 70.0),
        _row("compile(torchao-fp8-tensorwise bf16)", "torchao-fp8-tensorwise", "bfloat16",
             "compiled", 0.95, 70.0),  # fmt: skip
        _row("compile(O2+fp8-rowwise bf16)", "O2+fp8-rowwise", "bfloat16", "compiled", 1.0, 70.0),
        _row("compile(torchao-fp8-rowwise bf16)", "torchao-fp8-rowwise", "bfloat16", "compiled",
             0.9, 70.0),  # fmt: skip
        {
            "label": "compile(O1 bf16)",
            "recipe": "O1",
            "dtype": "bfloat16",
            "mode": "compiled",
            "status": "failed",
            "error": "boom",
        },  # fmt: skip
    ]
    got = {t["target"]: (t["met"], t["value"]) for t in check_targets(rows)}
    same = "step time at <= its memory"
    assert got[f"O2 bf16 >= 1.0x autocast bf16 {same}"] == (True, "speed 1.111x, memory 0.800x")
    assert got[f"O1 bf16 >= 1.0x autocast bf16 {same}"][0] is False
    assert got[f"O3 bf16 >= 1.0x autocast bf16 {same}"] == (False, "speed 1.053x, memory 1.010x")
    assert got[f"O2 fp16 >= 1.0x autocast+gradscaler fp16 {same}"][0] is False  # memory 1.2x
    lean = "lean bf16 >= 1.1x autocast bf16's speed at <= 0.6x its peak memory"
    assert got[lean] == (False, "speed 1.111x, memory 0.610x")
    assert got["O2 bf16 memory < autocast bf16's"] == (True, "0.800x")
    assert got["O2 fp16 memory < autocast+gradscaler fp16's"] == (False, "1.200x")
    assert got["compile(O2 bf16) memory < compile(autocast bf16)'s"] == (True, "0.700x")
    best = got["best compiled mixprec recipe >= 1.05x compile(autocast bf16)"]
    assert best == (False, "compile(O2 bf16): 0.941x")
    fp8 = "compile(O2+fp8 bf16) >= compile(torchao-fp8-tensorwise bf16) (float8 at torchao's speed)"
    assert got[fp8] == (True, "1.056x")
    rowwise = ("compile(O2+fp8-rowwise bf16) >= compile(torchao-fp8-rowwise bf16) (float8 at "
               "torchao's speed)")  # fmt: skip
    assert got[rowwise] == (False, "0.900x")
    assert got["MFU >= 50% of the measured bf16 matmul rate (aim)"] == (True, "O2 bf16: 55.0%")
    assert not any("compile(O1" in t for t in got)  # a failed recipe has no target row


def test_host_profile_runs_on_a_cpu_and_names_the_hot_functions(tmp_path):
    """``benchmarks.gpu_host_profile`` at the smoke size: a row per recipe with a step
    time and the Python functions by own time; the CUDA-only columns stay out."""
    from benchmarks import gpu_host_profile

    assert gpu_host_profile.main(["--out", str(tmp_path), "--device", "cpu", "--size", "smoke",
                                  "--steps", "1", "--only", "O2 bf16"]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "gpu_host_profile.json").read_text(encoding="utf-8"))
    (row,) = doc["rows"]
    assert row["label"] == "O2 bf16" and row["step_ms"] > 0
    assert row["python"]["calls_per_step"] > 100
    top = row["python"]["top"]
    assert top and all(fn["own_ms"] >= 0 and fn["calls"] > 0 for fn in top)
    assert top == sorted(top, key=lambda fn: -fn["own_ms"])
    assert "gpu_busy_ms" not in row and "idle" not in row
    assert "### O2 bf16" in (tmp_path / "gpu_host_profile.md").read_text(encoding="utf-8")


def test_idle_attribution_shares_each_gap_by_own_time():
    """A gap runs from one kernel's end to the next one's launch; the Python functions
    in it share it by own time (a callee's time is not its caller's), mixprec's also
    by time with callees."""
    from benchmarks.gpu_host_profile import idle_attribution

    def call(name, ts, dur, ident, parent):
        return {"cat": "python_function", "name": name, "ts": ts, "dur": dur,
                "args": {"Python id": ident, "Python parent id": parent}}  # fmt: skip

    events = [
        {"cat": "kernel", "ts": 0, "dur": 10, "args": {"correlation": 1}},
        {"cat": "kernel", "ts": 30, "dur": 10, "args": {"correlation": 2}},
        {"cat": "kernel", "ts": 50, "dur": 10, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "ts": 1, "dur": 1, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "ts": 25, "dur": 1, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "ts": 45, "dur": 1, "args": {"correlation": 3}},
        call("src/mixprec/optim/_masters.py(1): step", 5, 40, 1, 0),
        call("site-packages/torch/x.py(2): inner", 12, 8, 2, 1),
    ]
    out = idle_attribution({"traceEvents": events}, steps=1)
    # Gaps: 10-25 (the second kernel launched at 25) and 40-45: 20 us.
    assert out["gaps_per_step"] == 2 and out["idle_ms"] == pytest.approx(0.020)
    own = {row["function"]: row["self_ms"] for row in out["self"]}
    assert own == pytest.approx({"mixprec/optim/_masters.py(1): step": 0.012,
                                 "torch/x.py(2): inner": 0.008})  # fmt: skip
    assert out["mixprec_cumulative"] == [
        {"function": "mixprec/optim/_masters.py(1): step", "cumulative_ms": pytest.approx(0.020)}
    ]
