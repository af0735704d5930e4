"""The command line's polish (issue 32): ``--help``/``--version`` without torch, usage
on no arguments, a step bar that fits 80 columns whole, epoch lines and ``metrics.csv``
with stable columns and no blank cells, a ``loss_scale.png`` that says something for
bfloat16, and a validation split apart from the test set."""

from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

import numpy as np
import pytest
import torch

from mixprec.cli import main
from mixprec.train import plot_loss_scale, read_plot_data
from mixprec.train.callbacks import CSVLogger, PrecisionMonitor, ProgressBar, RunState
from mixprec.train.data import train_val_test_loaders

FAST = ["--model", "mlp", "--batch-size", "256", "--threads", "1", "--device", "cpu"]


# -- --help, --version, no arguments -----------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag):
    """What keeps them well under 1.5 s: torch (and numpy, matplotlib) never load."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mixprec", flag],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout
    loaded = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "numpy", "matplotlib", "tqdm")}
    assert heavy == set()
    assert "mixprec.cli._args" in loaded


def test_no_arguments_print_the_usage_and_exit_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: mixprec [-h] [--version] {train,compare,diagnose}")
    for command in ("train", "compare", "diagnose"):
        assert f"\n    {command} " in captured.err


def test_train_help_says_what_torchrun_shows(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "every process prints the same one error line and exits 2" in text
    assert "ChildFailedError" in text and "validation part" in text


# -- progress ----------------------------------------------------------------------------


def drive(bar: ProgressBar, metrics: list[dict], steps: int = 3, **numbers) -> None:
    state = RunState(epochs=len(metrics), steps_per_epoch=steps)
    bar.on_train_begin(state)
    for epoch, epoch_metrics in enumerate(metrics, 1):
        state.epoch, state.step_in_epoch = epoch, 0
        bar.on_epoch_begin(state)
        for _ in range(steps):
            state.step += 1
            state.step_in_epoch += 1
            state.loss, state.loss_scale = 0.5, 1024.0
            for key, value in numbers.items():
                setattr(state, key, value)
            bar.on_step_end(state)
        state.metrics = dict(epoch_metrics)
        bar.on_epoch_end(state)
    bar.on_train_end(state)


def test_the_step_bar_fits_80_columns_with_the_scale_and_skipped_steps():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    terminal = os.fdopen(follower, "w")
    try:  # the widest numbers a run shows: a 4-digit step count, 2^24, 5-digit skips
        drive(ProgressBar(file=terminal, mininterval=0), [{"loss": 0.5}], steps=1234,
              loss=1.2345e-3, loss_scale=2.0**24, skipped_steps=12345, samples_per_s=123456.0)  # fmt: skip
        terminal.flush()
    finally:
        terminal.close()
        reader.join(timeout=10)
        os.close(leader)
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    frames = [f for f in re.split(r"[\r\n]", text) if f.startswith("epoch 1 ")]
    assert frames and all(len(f) <= 80 for f in frames)
    assert frames[-1].startswith(
        "epoch 1 1234/1234, loss 0.001234  scale 2^24  skipped 12345  123k/s |"
    )
    assert frames[-1].endswith("|")  # the bar closes: nothing was cut off


def test_epoch_lines_keep_their_columns_when_a_metric_is_not_measured():
    log = io.StringIO()
    drive(ProgressBar(file=log), [{"loss": 0.5, "grad_underflow": 0.25}, {"loss": 0.25}])
    lines = log.getvalue().splitlines()
    names = [re.findall(r"  ([a-z_]+) ", line) for line in lines]
    assert names[0] == names[1] == ["loss", "grad_underflow", "scale", "skipped"]
    assert "  grad_underflow nan  " in lines[1]


def test_the_precision_monitor_always_reports_grad_underflow():
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = PrecisionMonitor(every=100, dtype=torch.bfloat16, file=io.StringIO())
    state = RunState(model=net, optimizer=opt)
    monitor.on_train_begin(state)
    reported = []
    for epoch in (1, 2):
        state.epoch, state.metrics = epoch, {}
        monitor.on_epoch_begin(state)
        for _ in range(2):  # only step 1 is sampled (every 100)
            opt.zero_grad()
            net(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            state.step += 1
            monitor.on_step_end(state)
        monitor.on_epoch_end(state)
        reported.append(state.metrics["grad_underflow"])
    monitor.on_train_end(state)
    assert 0.0 <= reported[0] <= 1.0 and math.isnan(reported[1])


def test_metrics_csv_has_a_stable_header_and_no_blank_cells(tmp_path):
    path = tmp_path / "metrics.csv"
    log = CSVLogger(path)
    state = RunState()
    log.on_train_begin(state)
    for epoch, metrics in enumerate(({"loss": 0.5}, {"loss": 0.25, "val_accuracy": 0.75}), 1):
        state.epoch, state.step, state.metrics = epoch, 10 * epoch, metrics
        log.on_epoch_end(state)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][-2:] == ["loss", "val_accuracy"]
    assert rows[1][-1] == "nan" and rows[2][-1] == "0.75"
    assert all(cell != "" for row in rows for cell in row)
    # A log written with blank cells (by an older version) is resumed without them.
    path.write_text("epoch,step,loss,val_accuracy\n1,10,0.5,\n2,20,0.25,0.75\n")
    resumed = CSVLogger(path, append=True)
    resumed.on_train_begin(RunState(epoch=2))
    assert path.read_text().splitlines()[1:] == [
        "1,10,nan,nan,nan,0.5,nan",
        "2,20,nan,nan,nan,0.25,0.75",
    ]


def test_the_loss_scale_plot_says_what_the_run_did(tmp_path):
    """The title follows the scales the run used: a bfloat16 run (not scaled by default)
    shows its scale of 1 as "not scaled", one that was scaled says so."""
    path = tmp_path / "loss_scale.png"
    plot_loss_scale([1.0] * 300, [False] * 299 + [True], path, underflow=([1, 101, 201],
                    [0.0, 0.002, 0.001]), dtype="bfloat16", loss_scale="none")  # fmt: skip
    data = read_plot_data(path)
    assert data["note"] == "not scaled: bfloat16 has float32's exponent range"
    assert data["underflow_fractions"] == [0.0, 0.002, 0.001]
    assert data["scales"] == [1.0] * 300 and data["skipped_steps"] == [300]
    scaled = tmp_path / "scaled.png"
    plot_loss_scale([32768.0] * 3, [False] * 3, scaled, dtype="bfloat16", loss_scale="dynamic")
    assert read_plot_data(scaled)["note"] == "dynamic: 32768 throughout"
    plot_loss_scale([65536.0, 32768.0], [True, False], scaled, dtype="float16",
                    loss_scale="dynamic")  # fmt: skip
    assert read_plot_data(scaled)["note"] == "dynamic: 32768 to 65536"
    plot_loss_scale([1.0] * 2, [False] * 2, scaled, dtype="float32", loss_scale="none")
    assert read_plot_data(scaled)["note"] == "not scaled: float32 (level O0)"


def test_the_main_job_scales_bfloat16_as_the_library_does(tmp_path, capsys):
    """One loss-scale story: bfloat16 unscaled by default, as amp.initialize and Model."""
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--epochs", "1", "--quiet", "--level", "O2", *FAST]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["loss_scale"] == "none"
    assert "loss scale none: level O2's own for bfloat16" in capsys.readouterr().out
    data = read_plot_data(out / "loss_scale.png")
    assert set(data["scales"]) == {1.0} and data["note"].startswith("not scaled: bfloat16")
    assert main([*argv, "--dtype", "float16", "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["loss_scale"] == "dynamic"


# -- a validation split apart from the test set ------------------------------------------


def test_validation_is_carved_from_the_training_part():
    train, val, test = train_val_test_loaders(batch_size=64, seed=3, image=False)
    rows = {name: {tuple(x.tolist()) for x in loader.dataset.tensors[0]}
            for name, loader in (("train", train), ("val", val), ("test", test))}  # fmt: skip
    assert not rows["train"] & rows["val"] and not rows["val"] & rows["test"]
    assert not rows["train"] & rows["test"]
    _, test_only = train_val_test_loaders(batch_size=64, seed=3, image=False)[::2]
    assert torch.equal(test.dataset.tensors[1], test_only.dataset.tensors[1])
    again = train_val_test_loaders(batch_size=64, seed=3, image=False)[1]
    assert torch.equal(val.dataset.tensors[0], again.dataset.tensors[0])
    with pytest.raises(ValueError, match="val_fraction must be a number in"):
        train_val_test_loaders(val_fraction=1.0)
    x, y = torch.zeros(6, 2), torch.tensor([0, 1, 0, 1, 0, 1])
    with pytest.raises(ValueError, match="too few to hold out a validation part"):
        train_val_test_loaders(x, y, test_fraction=0.5, val_fraction=0.5)


def test_the_command_validates_on_the_carved_part_and_tests_once(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--epochs", "2", "--quiet", *FAST]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["samples"] == {"train": 1293, "validation": 145, "test": 359}
    assert metrics["val_accuracy"] == metrics["history"]["epochs"]["val_accuracy"][-1]
    assert metrics["steps"] == 2 * math.ceil(1293 / 256)
    assert f"test accuracy: {metrics['test_accuracy']:.4f}" in printed
    assert "(359 test samples, evaluated once)" in printed
    accuracy = read_plot_data(out / "accuracy.png")
    assert accuracy["validation"] == metrics["history"]["epochs"]["val_accuracy"]
    assert accuracy["test"] == metrics["test_accuracy"]


def test_too_little_data_for_a_validation_part_is_one_line(tmp_path, capsys):
    data = tmp_path / "tiny.npz"
    np.savez(data, x=np.ones((10, 2)), y=np.arange(10) % 2)  # 8 to train: 0 to validate
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(data), *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mixprec: error: --data {data}: ")
    assert "validation" in err[0] and not (tmp_path / "run").exists()
