"""Progress: a live bar on a terminal, one line per epoch anywhere else (a log file, a
pipe), never hundreds of redrawn bar lines."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

from mixprec.cli import main
from mixprec.train.callbacks import ProgressBar, RunState

ARGS = [
    "--model",
    "mlp",
    "--batch-size",
    "256",
    "--epochs",
    "3",
    "--threads",
    "1",
    "--device",
    "cpu",
]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drive(bar: ProgressBar, epochs: int = 2, steps: int = 3) -> None:
    state = RunState(epochs=epochs, steps_per_epoch=steps)
    bar.on_train_begin(state)
    for epoch in range(1, epochs + 1):
        state.epoch, state.step_in_epoch = epoch, 0
        bar.on_epoch_begin(state)
        for _ in range(steps):
            state.step += 1
            state.step_in_epoch += 1
            state.loss, state.loss_scale = 0.5, 1024.0
            bar.on_step_end(state)
        state.metrics = {"loss": 0.5, "val_accuracy": 0.875}
        bar.on_epoch_end(state)
    bar.on_train_end(state)


def test_the_bar_is_live_on_a_terminal_and_lines_elsewhere():
    terminal, log = Terminal(), io.StringIO()
    drive(ProgressBar(file=terminal, mininterval=0))
    drive(ProgressBar(file=log))
    assert "\r" in terminal.getvalue() and "training: 100%" in terminal.getvalue()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue()
    assert re.fullmatch(
        r"epoch 2/2  loss 0\.5  val_accuracy 0\.875  scale 1024  skipped 0  \(\d+\.\d s\)", lines[1]
    )
    forced = io.StringIO()
    drive(ProgressBar(file=forced, live=True, mininterval=0))
    assert "training: 100%" in forced.getvalue()


def test_the_command_prints_one_line_per_epoch_when_not_on_a_terminal(tmp_path, capsys):
    assert main(["train", *ARGS, "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    epochs = [line for line in captured.out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in epochs] == ["1/3", "2/3", "3/3"]
    assert captured.err == ""  # no bars piling up in a log


def test_the_command_draws_a_live_bar_on_a_terminal(tmp_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the terminal closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "train", *ARGS, "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.close(follower)
    reader.join(timeout=10)
    os.close(leader)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0
    assert "\r" in terminal and "training: 100%" in terminal and "3/3" in terminal
    assert not any(line.startswith("epoch ") for line in proc.stdout.splitlines())
