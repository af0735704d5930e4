"""Ctrl-C (SIGINT) at deterministic points of ``mixprec train`` and ``mixprec compare``
(issue 29): one line on stderr, exit code 130, nothing half-written, no lock left, and a
train run that resumes to the weights of a run never interrupted.

Each run is a child process that stops at the point under test, writes its pid to a
"ready" file and waits; the test sends SIGINT only once that file is there, so the
signal lands at the point every time, however loaded the machine (no sleeping and
hoping). The points: in the middle of an epoch's steps, in the middle of writing a
checkpoint, during an epoch's validation, during the final test evaluation, and
during a ``compare`` level (SIGINT to the whole process group, as a terminal's Ctrl-C
sends it: the level's process ignores it and its parent stops it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixprec.cli import main

pytestmark = [
    pytest.mark.slow,  # each point runs a fresh Python process that imports torch
    pytest.mark.skipif(sys.platform != "linux", reason="signals and process groups: Linux"),
]

TESTS = Path(__file__).resolve().parent
#: The lock file a running mixprec holds in its run folder (docs/guides/cli.md).
RUN_LOCK = ".mixprec.lock"
ARGS = ["--model", "mlp", "--batch-size", "256", "--epochs", "3", "--threads", "1",
        "--device", "cpu", "--quiet"]  # fmt: skip

#: The child: arm the point named by argv[1], then run the command in argv[3:].
DRIVER = r"""
import os, sys, time
from pathlib import Path

point, ready = sys.argv[1], Path(sys.argv[2])


def wait_for_sigint():
    ready.write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # SIGINT ends this sleep as KeyboardInterrupt
        time.sleep(0.01)
    sys.exit("no SIGINT came")


import io

import mixprec
from mixprec.train.callbacks import ProgressBar

if point == "step":  # epoch 2, after its second step
    step_end = ProgressBar.on_step_end

    def on_step_end(self, state):
        step_end(self, state)
        if state.epoch == 2 and state.step_in_epoch == 2:
            wait_for_sigint()

    ProgressBar.on_step_end = on_step_end
elif point == "checkpoint":  # half of epoch 2's checkpoint written to its temporary file
    real = io.open  # what os.fdopen opens a written file's descriptor with

    class Slow:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            if ready.exists():  # torch.save writes on after a failed write: let it
                return self.f.write(data)
            half = len(data) // 2
            self.f.write(data[:half])
            self.f.flush()
            wait_for_sigint()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fdopen(fd, *a, **k):
        f = real(fd, *a, **k)
        if isinstance(fd, int) and ".epoch0002.pt." in os.readlink(f"/proc/self/fd/{fd}"):
            return Slow(f)
        return f

    io.open = fdopen
elif point in ("validation", "test"):  # epoch 2's validation; the final test evaluation
    calls = {"n": 0}
    real_eval = mixprec.Model.eval
    at = 2 if point == "validation" else 4  # 3 epochs: 3 validations, then the test

    def eval_(self, dataset):
        calls["n"] += 1
        if calls["n"] == at:
            wait_for_sigint()
        return real_eval(self, dataset)

    mixprec.Model.eval = eval_
elif point == "compare":
    sys.path.insert(0, sys.argv[3])
    import mixprec.cli._compare as compare
    import test_cli_interrupts

    compare.level_target = test_cli_interrupts.level_waits
    os.environ["READY_FILE"] = str(ready)

from mixprec.cli import main

sys.exit(main(sys.argv[4 if point == "compare" else 3:]))
"""


def level_waits(args, entry):
    """A compare level (in its spawned process): O2 stops and waits; the others answer."""
    if entry == "O2":
        Path(os.environ["READY_FILE"]).write_text(str(os.getpid()))
        time.sleep(120)  # SIGINT is ignored in a level's process: only a kill ends this
    return {"config": entry, "accuracy": 0.5, "loss": 1.0, "step_ms": 1.0, "peak_mb": 1.0,
            "skipped_steps": 0}  # fmt: skip


def interrupt(point: str, tmp_path: Path, argv: list[str], group: bool = False):
    """Run the driver at ``point``; SIGINT it once it is there. ``(rc, stderr lines, pid)``."""
    ready = tmp_path / f"ready-{point}"
    extra = [str(TESTS)] if point == "compare" else []
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, point, str(ready), *extra, *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (ready.is_file() and ready.read_text()) and proc.poll() is None:
            assert time.monotonic() < deadline, "the child never reached the point"
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        if group:  # a terminal's Ctrl-C: every process of the foreground group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err.strip().splitlines(), int(ready.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of the same run, never interrupted."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--out", str(out), *ARGS]) == 0
    return torch.load(out / "checkpoints" / "epoch0003.pt", weights_only=True)["model"]


@pytest.mark.parametrize(
    "point,saved", [("step", 1), ("checkpoint", 1), ("validation", 1), ("test", 3)]
)
def test_sigint_is_one_line_130_and_the_run_resumes_exactly(tmp_path, reference, point, saved):
    out = tmp_path / "run"
    rc, err, _ = interrupt(point, tmp_path, ["train", "--out", str(out), *ARGS])
    assert rc == 130 and len(err) == 1, err
    assert err[0] == (
        f"mixprec: interrupted in {out}; resume it from epoch{saved:04d}.pt with: "
        f"mixprec train --resume {out}"
    )
    # Nothing half-written: no temporary file, no lock, only whole checkpoints.
    assert not [p.name for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert not (out / RUN_LOCK).exists()
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [f"epoch{e:04d}.pt" for e in range(max(1, saved - 1), saved + 1)]
    for name in names:
        torch.load(out / "checkpoints" / name, weights_only=True)
    assert json.loads((out / "config.json").read_text())["epochs"] == 3
    assert main(["train", "--resume", str(out)]) == 0
    final = torch.load(out / "checkpoints" / "epoch0003.pt", weights_only=True)["model"]
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == ["1", "2", "3"]
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 3


def test_sigint_during_compare_stops_the_level_and_keeps_the_table(tmp_path):
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "O0,O2,O1", "--out", str(out), "--epochs", "1",
            "--model", "mlp", "--threads", "1", "--device", "cpu", "--quiet"]  # fmt: skip
    rc, err, level_pid = interrupt("compare", tmp_path, argv, group=True)
    assert rc == 130 and len(err) == 1, err
    assert err[0] == (
        f"mixprec: interrupted during level O2 (2/3); {out / 'compare.json'} holds the 1 "
        "level(s) done before it"
    )
    rows = json.loads((out / "compare.json").read_text())
    assert [(r["entry"], r["status"]) for r in rows] == [("O0", "ok"), ("O2", "interrupted")]
    assert rows[1]["exit_code"] == 130
    with pytest.raises(ProcessLookupError):  # the level's process is gone, not orphaned
        os.kill(level_pid, 0)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
