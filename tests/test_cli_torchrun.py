"""``mixprec train`` under a real ``torchrun`` (2 ranks, gloo on 127.0.0.1): bad input
is one line on every rank and exit code 2 from each, with no traceback of ours; what
follows is torchrun's own failure summary (its ``ChildFailedError`` naming each rank's
exit code) and torchrun's exit code 1.

Each rank's output is captured apart by torchrun itself (``--redirects 3 --log-dir``),
so the test reads what each rank printed, not a mix of both.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,  # two Python processes that import torch and join a process group
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo: Linux here"),
]

FAST = ["--model", "mlp", "--epochs", "1", "--threads", "1", "--device", "cpu", "--quiet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(logs: Path, *argv: str) -> tuple[int, str, list[list[str]]]:
    """``torchrun --nproc-per-node 2 -m mixprec train ARGV``: (exit code, torchrun's own
    stderr, each rank's stderr lines). Bounded in time; the whole group is killed after."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--redirects", "3", "--log-dir", str(logs),
           "-m", "mixprec", "train", *argv]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    ranks = []
    for rank in (0, 1):
        found = sorted(logs.rglob(f"{rank}/stderr.log"))
        assert len(found) == 1, found
        ranks.append(found[0].read_text().strip().splitlines())
    return proc.returncode, err, ranks


def test_bad_input_is_one_line_and_exit_2_on_every_rank(tmp_path):
    out = tmp_path / "run"
    rc, err, ranks = torchrun(tmp_path / "logs", "--out", str(out), "--batch-size", "127", *FAST)
    line = (
        "mixprec: error: --batch-size 127 (the global batch) does not split evenly over 2 "
        "processes; pass a multiple of 2"
    )
    assert ranks == [[line], [line]]
    assert rc == 1 and "ChildFailedError" in err  # torchrun's own summary
    assert err.count("exitcode  : 2") == 2  # each rank exited 2
    assert not out.exists()


def test_a_folder_held_elsewhere_is_one_line_on_every_rank(tmp_path, hold_run_folder):
    """Only rank 0 takes the folder's lock: without the ranks agreeing, rank 1 went on
    into training and was killed by torchrun without a word."""
    out = tmp_path / "run"
    with hold_run_folder(out):  # as another mixprec process holds it
        t0 = time.monotonic()
        rc, err, ranks = torchrun(tmp_path / "logs", "--out", str(out), *FAST)
    line = (
        f"mixprec: error: --out {out}: the run folder is in use by mixprec process "
        f"{os.getpid()}; wait for it to finish (or stop it), or choose another folder"
    )
    assert ranks == [[line], [line]], ranks
    assert rc == 1 and err.count("exitcode  : 2") == 2, err[-2000:]
    assert time.monotonic() - t0 < 240
    assert not (out / "config.json").exists()
