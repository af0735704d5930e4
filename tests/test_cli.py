"""The mixprec command: the main job, its files and plots, resume, compare, and bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from mixprec.amp import LEVEL_SPECS, choose_auto
from mixprec.cli import main
from mixprec.train import read_plot_data

FAST = ["--quiet", "--threads", "1", "--device", "cpu"]  # the CPU is the reference here


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mixprec", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_default_train_reaches_95_percent(tmp_path):
    """`mixprec train` with defaults (only the output folder moved): LeNet-5 at the level and
    dtype auto picks by the hardware, the level's own loss scale, one CPU thread; the header
    says what was chosen and why."""
    out = tmp_path / "run"
    proc = run_cli("train", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    device = "cuda" if torch.cuda.is_available() else "cpu"
    level, dtype, why = choose_auto(device)
    name = "float32" if level == "O0" else str(dtype).removeprefix("torch.")
    scale = LEVEL_SPECS[level].default_loss_scale(dtype).kind if level != "O0" else "none"
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"mixprec train: lenet5 on digits, level {level}, {name}, loss scale "
                        f"{scale}, {device}" + (", 1 thread" if device == "cpu" else ""))  # fmt: skip
    assert lines[1] == f"auto: level {level}, {name}: {why}"
    if device == "cpu":
        assert lines[2].startswith("threads 1: fastest for these small models")
        # The CLI guide shows these lines for this kind of CPU ("..." cuts a long one).
        guide = (Path(__file__).resolve().parents[1] / "docs/guides/cli.md").read_text()
        shown = [block.strip().splitlines() for block in guide.split("```text\n")[1:]]
        shown = [b[: b.index("```")] for b in shown if b[0] == lines[0]]
        header = lines[: next(i for i, x in enumerate(lines) if x.startswith("test accuracy"))]
        assert len(shown) == 1 and len(shown[0]) == len(header), (shown, header)
        for want, got in zip(shown[0], header):
            assert got == want or (want.endswith("...") and got.startswith(want[:-3])), (want, got)
    assert "test accuracy:" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.95, metrics["test_accuracy"]
    config = metrics["config"]
    assert (config["level"], config["amp_level"], config["dtype"]) == ("auto", level, name)
    assert config["loss_scale"] == scale and config["model"] == "lenet5"
    assert config["threads"] == (1 if device == "cpu" else None)
    assert metrics["steps"] == 15 * 41  # 1293 training digits (145 more validate) / 32


def test_outputs_and_plots_hold_the_data(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--epochs", "2", "--loss-scale", "65536", *FAST]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    hist = metrics["history"]
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(hist["epochs"]["val_accuracy"][-1])
    # Each plot is a real image, and carries exactly the data it plots.
    for name in ("loss.png", "accuracy.png", "loss_scale.png"):
        pixels = imread(out / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and float(pixels.std()) > 0.01
    assert read_plot_data(out / "loss.png")["losses"] == hist["loss"]
    assert read_plot_data(out / "accuracy.png")["validation"] == hist["epochs"]["val_accuracy"]
    assert read_plot_data(out / "accuracy.png")["test"] == metrics["test_accuracy"]
    scale_data = read_plot_data(out / "loss_scale.png")
    assert scale_data["scales"] == hist["loss_scale"] == [65536.0] * metrics["steps"]
    assert scale_data["skipped_steps"] == [i + 1 for i, s in enumerate(hist["skipped"]) if s]
    # Gradient underflow, sampled by the precision monitor, beside the scale.
    # Sampled once an epoch (epochs of 41 steps are shorter than the monitor's 100), so
    # that every epoch line has its number.
    samples = metrics["precision"]["samples"]
    assert [s["step"] for s in samples] == [1, 42]
    assert all(0.0 <= s["underflow_fraction"] <= 1.0 for s in samples)
    assert scale_data["underflow_steps"] == [1, 42]
    assert scale_data["underflow_fractions"] == [s["underflow_fraction"] for s in samples]
    assert scale_data["note"] == "static: 65536 throughout"
    assert all(not math.isnan(v) for v in hist["epochs"]["grad_underflow"])


def test_loss_scale_plot_marks_skipped_steps(tmp_path):
    """float16 with a huge static scale overflows: every step is skipped and marked, and
    the run, which learned nothing, exits 3 after saving (a failed run)."""
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--out",
                str(out),
                "--epochs",
                "1",
                "--level",
                "O2",
                "--dtype",
                "float16",
                "--loss-scale",
                "1e30",
                "--model",
                "mlp",
                "--batch-size",
                "256",
                *FAST,
            ]
        )
        == 3
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_steps"] == metrics["steps"] > 0
    assert read_plot_data(out / "loss_scale.png")["skipped_steps"] == list(
        range(1, metrics["steps"] + 1)
    )


def test_resume_gives_the_same_final_weights(tmp_path, monkeypatch, dies_after_epoch):
    common = ["--epochs", "4", "--model", "mlp", "--batch-size", "128", *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", "--out", str(full), *common]) == 0
    interrupted = dies_after_epoch(2)
    with pytest.raises(interrupted):
        main(["train", "--out", str(part), *common])
    monkeypatch.undo()
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == [
        "epoch0001.pt",
        "epoch0002.pt",
    ]
    assert main(["train", "--out", str(part), "--resume", str(part), *FAST]) == 0
    a = torch.load(full / "checkpoints" / "epoch0004.pt", weights_only=False)
    b = torch.load(part / "checkpoints" / "epoch0004.pt", weights_only=False)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert (
        json.loads((full / "metrics.json").read_text())["test_accuracy"]
        == json.loads((part / "metrics.json").read_text())["test_accuracy"]
    )
    with open(part / "metrics.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]
    # Resuming to fewer epochs than the run has done is refused (more extends it: see
    # test_run_folders.py).
    assert main(["train", "--out", str(part), "--resume", str(part), "--epochs", "3"]) == 2


def test_user_data_files(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.savetxt(tmp_path / "d.csv", np.column_stack([x, y]), delimiter=",")
    for name in ("d.npz", "d.csv"):
        out = tmp_path / f"out_{name}"
        assert (
            main(
                [
                    "train",
                    "--data",
                    str(tmp_path / name),
                    "--model",
                    "mlp",
                    "--epochs",
                    "3",
                    "--out",
                    str(out),
                    *FAST,
                ]
            )
            == 0
        )
        assert json.loads((out / "metrics.json").read_text())["test_accuracy"] > 0.7


def _bad_inputs(tmp_path):
    np.savez(tmp_path / "noxy.npz", features=np.ones((4, 2)))
    np.savez(tmp_path / "neg.npz", x=np.ones((4, 2)), y=np.array([0, 1, -1, 1]))
    np.savez(tmp_path / "frac.npz", x=np.ones((4, 2)), y=np.array([0, 1.5, 1, 0]))
    (tmp_path / "a_file").write_text("not a folder")
    return [
        (["--data", str(tmp_path / "missing.npz")], "missing.npz"),
        (["--data", str(tmp_path / "noxy.npz")], "x"),
        (["--data", str(tmp_path / "neg.npz")], "label"),
        (["--data", str(tmp_path / "frac.npz")], "label"),
        (["--level", "O7"], "--level"),
        (["--dtype", "float8"], "--dtype"),
        (["--loss-scale", "lots"], "--loss-scale"),
        (["--epochs", "0"], "--epochs"),
        (["--out", str(tmp_path / "a_file")], "a_file"),
        (["--resume", str(tmp_path / "nowhere")], "--resume"),
    ]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    for extra, needle in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        argv = ["train", *extra] if "--out" in extra else ["train", "--out", str(out), *extra]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mixprec: error:") and needle in err[0], err
        assert not out.exists(), extra


def test_bad_input_through_the_real_entry_point(tmp_path):
    proc = run_cli("train", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "none.csv"))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--level",
        "--dtype",
        "--loss-scale",
        "--model",
        "--data",
        "--epochs",
        "--batch-size",
        "--lr",
        "--seed",
        "--device",
        "--out",
        "--resume",
        "--threads",
    ):
        assert option in text, option
    for level in ("O0", "O1", "O2", "O3", "auto", "rewrite"):
        assert level in text


def test_compare_prints_one_table(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(
        [
            "compare",
            "--levels",
            "O0,O2",
            "--epochs",
            "2",
            "--model",
            "mlp",
            "--out",
            str(out),
            "--threads",
            "1",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "config" in text and "peak MB" in text and "O2 bfloat16" in text
    rows = json.loads((out / "compare.json").read_text())
    assert [r["config"] for r in rows] == ["O0", "O2 bfloat16"]
    assert all(r["accuracy"] > 0.5 and r["step_ms"] > 0 and r["peak_mb"] > 10 for r in rows)
    # The spread: the epochs' median step times, the first epoch (warm-up) left out.
    for r in rows:
        assert len(r["step_ms_epochs"]) == 1 and r["step_ms_range"] == [r["step_ms_epochs"][0]] * 2
    assert text.splitlines()[-2].startswith("step time against O0: O2 bfloat16 ")
    # A line per epoch per level as it trains, on stderr, and the emulation note first.
    epochs = [line for line in captured.err.splitlines() if ": epoch " in line]
    assert [line.split(",")[0] for line in epochs] == [
        "  [1/2] O0: epoch 1/2", "  [1/2] O0: epoch 2/2",
        "  [2/2] O2: epoch 1/2", "  [2/2] O2: epoch 2/2",
    ]  # fmt: skip
    emulated = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    notes = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert len(notes) == emulated and all("O2 train in it" in n for n in notes)
    assert [r["config"] for r in read_plot_data(out / "compare.png")["rows"]] == [
        "O0",
        "O2 bfloat16",
    ]
    assert main(["compare", "--levels", "O0,O9", "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow  # nine compiles (training, the last short batch, evaluation): 26 s cold
def test_compare_puts_compiled_entries_beside_eager(tmp_path):
    """``O2+compile`` trains the same run under torch.compile: same data, same seed, so
    the accuracy matches the eager entry's closely."""
    out = tmp_path / "cmp"
    rc = main(["compare", "--levels", "O2,O2+compile", "--epochs", "1", "--model", "mlp",
               "--out", str(out), *FAST])  # fmt: skip
    assert rc == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["config"] for r in rows] == ["O2 bfloat16", "O2 bfloat16 compiled"]
    assert abs(rows[0]["accuracy"] - rows[1]["accuracy"]) <= 0.02
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 0.02 * rows[0]["loss"] + 1e-3


def test_compare_refuses_an_unknown_level_option_in_one_line(tmp_path, capsys):
    assert main(["compare", "--levels", "O2+fast", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "'fast'" in err and "O2+compile" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_float32_run_records_float32_and_resumes(tmp_path, capsys):
    """An O0 run (what auto picks on a CPU without bfloat16 units) is float32 in its
    header and config.json, with no loss scale, and resumes."""
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--level", "O0", "--model", "mlp", "--epochs", "1"]
    assert main([*argv, "--batch-size", "256", *FAST]) == 0
    assert "level O0, float32, loss scale none, cpu, 1 thread" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["dtype"], config["loss_scale"], config["threads"]) == ("float32", "none", 1)
    assert main(["train", "--resume", str(out), "--epochs", "2", "--quiet"]) == 0
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 2


def test_bad_input_is_named_before_a_folder_that_holds_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--model", "mlp", "--epochs", "1", *FAST]
    assert main([*argv, "--batch-size", "256"]) == 0
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main([*argv, "--data", str(tmp_path / "missing.npz")]) == 2
    err = capsys.readouterr().err
    assert "missing.npz" in err and "already holds a run" not in err
    if not torch.cuda.is_available():
        assert main([*argv, "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "CUDA is not available" in err and "already holds a run" not in err
    assert main(argv) == 2  # the inputs are good: now the folder is the problem
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.parametrize("command", ["train", "compare", "diagnose"])
def test_a_mistyped_data_path_fails_before_torch_loads(tmp_path, command):
    """The checks that need no torch come first: a wrong path is one line at once."""
    missing = tmp_path / "digits.npz"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mixprec", command, "--data", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if "import time:" not in line]
    assert proc.returncode == 2 and lines == [
        f"mixprec: error: --data {missing}: no such file; check the path"
    ]
    loaded = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "numpy", "matplotlib")}
