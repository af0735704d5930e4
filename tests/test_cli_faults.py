"""The command line under faults (issue 29): each fault is one line on stderr with the
right exit code, names the file at fault, and changes nothing outside the run folder nor
in another run; the run stays resumable.

Faults: symlinks in a run folder (``--overwrite`` through a linked ``checkpoints/``,
dangling links named like run files), two processes on one folder (an OS lock), a run
that skipped every step, a full disk while saving a checkpoint, checkpoints that do not
fit the model or lack entries, a damaged ``metrics.csv`` or ``config.json``, extreme
options, data beyond float32, a numeric CSV header, strict JSON in ``metrics.json``,
``--resume`` keeping ``compile``, SIGINT, and ``compare`` with failing levels.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mixprec.cli import main
from mixprec.train import atomic_write

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="flock and O_NOFOLLOW: Linux")

#: The lock file a running mixprec holds in its run folder (docs/guides/cli.md).
RUN_LOCK = ".mixprec.lock"

FAST = ["--model", "mlp", "--batch-size", "256", "--threads", "1", "--quiet", "--device", "cpu"]


def train(*argv: str) -> int:
    return main(["train", *argv])


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def one_line(capsys, start: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(start), err[0]
    return err[0]


@pytest.fixture
def victim(tmp_path) -> Path:
    """A finished 2-epoch run: the one no fault elsewhere may touch."""
    run = tmp_path / "victim"
    assert train("--out", str(run), "--epochs", "2", *FAST) == 0
    return run


# -- (1) symlinks ------------------------------------------------------------------------


def test_overwrite_never_deletes_through_a_linked_checkpoints_folder(tmp_path, victim, capsys):
    before = digest(victim)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((victim / "config.json").read_text())
    (copy / "checkpoints").symlink_to(victim / "checkpoints")
    capsys.readouterr()
    assert train("--out", str(copy), "--epochs", "1", *FAST) == 2  # a run is there
    one_line(capsys, "mixprec: error: --out")
    assert train("--out", str(copy), "--epochs", "1", "--overwrite", *FAST) == 0
    assert digest(victim) == before  # nothing deleted or written through the link
    assert not (copy / "checkpoints").is_symlink()
    assert [p.name for p in (copy / "checkpoints").iterdir()] == ["epoch0001.pt"]


def test_resume_refuses_a_folder_with_linked_checkpoints(tmp_path, victim, capsys):
    before = digest(victim)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "metrics.csv"):
        (copy / name).write_text((victim / name).read_text())
    (copy / "checkpoints").symlink_to(victim / "checkpoints")
    capsys.readouterr()
    assert train("--resume", str(copy), "--epochs", "3") == 2
    line = one_line(capsys, "mixprec: error: --resume")
    assert "checkpoints is a link to" in line
    assert digest(victim) == before


def test_dangling_links_named_like_run_files_are_run_files(tmp_path, capsys):
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "config.json").symlink_to(outside / "config.json")
    (out / "metrics.json").symlink_to(outside / "metrics.json")
    assert train("--out", str(out), "--epochs", "1", *FAST) == 2
    assert "already holds a run (config.json, metrics.json)" in one_line(capsys, "mixprec: error")
    assert train("--out", str(out), "--epochs", "1", "--overwrite", *FAST) == 0
    assert list(outside.iterdir()) == []  # written in the folder, never through the links
    assert not (out / "config.json").is_symlink() and (out / "metrics.json").is_file()


def test_atomic_write_replaces_a_link_and_uses_per_process_names(tmp_path):
    target = tmp_path / "target"
    target.write_text("theirs")
    (tmp_path / "mine").symlink_to(target)
    written_to = []

    def write(f):
        written_to.extend(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
        f.write(b"ours")

    atomic_write(tmp_path / "mine", write)
    assert target.read_text() == "theirs" and (tmp_path / "mine").read_text() == "ours"
    [name] = written_to  # a temporary name of this process beside the file, gone after
    assert name.startswith(".mine.") and f".{os.getpid()}." in name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "target"]


# -- (2) one process per run folder ------------------------------------------------------


def test_a_held_folder_is_refused_naming_the_holder(tmp_path, victim, capsys, hold_run_folder):
    with hold_run_folder(victim):  # as another mixprec process holds it
        before = digest(victim)
        capsys.readouterr()
        for argv in (
            ["--resume", str(victim), "--epochs", "3"],
            ["--out", str(victim), "--overwrite", "--epochs", "1", *FAST],
        ):
            assert train(*argv) == 2
            line = one_line(capsys, "mixprec: error:")
            assert f"in use by mixprec process {os.getpid()}" in line
            assert digest(victim) == before
    assert train("--resume", str(victim), "--epochs", "3") == 0  # free again
    assert not (victim / RUN_LOCK).exists()  # the run's own lock went with it


#: A process that holds a run folder as a running mixprec does (an flock on its lock file,
#: which holds the pid), then sleeps.
LOCK_HOLDER = """
import fcntl, os, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
fd = os.open(folder / ".mixprec.lock", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


def test_the_lock_is_released_when_its_process_dies(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert train("--out", str(out), "--epochs", "1", *FAST) == 2
        assert f"process {holder.pid}" in one_line(capsys, "mixprec: error: --out")
        assert not (out / "config.json").exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert train("--out", str(out), "--epochs", "1", *FAST) == 0  # a crash frees it


@pytest.mark.slow
def test_two_concurrent_runs_never_mix_a_folder(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mixprec", "train", "--out", str(out), "--epochs", "3", *FAST]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = sorted(rc for rc, _ in results)
    # Either the second saw the first's lock (2), or the first had finished (2, a run).
    assert codes == [0, 2], results
    epochs = [line.split(",")[0] for line in (out / "metrics.csv").read_text().splitlines()[1:]]
    assert epochs == ["1", "2", "3"]


# -- (3) a run that skipped every step ---------------------------------------------------


@pytest.mark.parametrize("extra", [["--dtype", "float16", "--loss-scale", "1e30"],
                                   ["--max-skipped-fraction", "0.5", "--dtype", "float16",
                                    "--loss-scale", "1e8"]])  # fmt: skip
def test_a_run_that_skipped_its_steps_fails_after_saving(tmp_path, capsys, extra):
    out = tmp_path / "run"
    assert train("--out", str(out), "--epochs", "1", "--level", "O2", *FAST, *extra) == 3
    line = one_line(capsys, "mixprec: diverged:")
    assert "steps were skipped" in line
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["diverged"] in line and metrics["skipped_steps"] >= metrics["steps"] / 2 > 0
    assert (out / "checkpoints" / "epoch0001.pt").is_file()


# -- (4) one line for what a user can meet -----------------------------------------------


def test_disk_full_while_saving_a_checkpoint(tmp_path, monkeypatch, capsys):
    """The disk fills while epoch 2's checkpoint is written: the file object over its
    temporary file (``os.fdopen`` opens it through ``io.open``) fails every write."""
    out = tmp_path / "run"
    real = io.open
    calls = {"n": 0}

    class Full:  # a file on a full disk: every write fails with ENOSPC
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fdopen(fd, *a, **k):
        f = real(fd, *a, **k)
        if isinstance(fd, int) and ".epoch0002.pt." in os.readlink(f"/proc/self/fd/{fd}"):
            calls["n"] += 1
            return Full(f)
        return f

    monkeypatch.setattr(io, "open", fdopen)
    assert train("--out", str(out), "--epochs", "3", *FAST) == 1
    line = one_line(capsys, "mixprec: error: no space left on device writing ")
    assert line.endswith("epoch0002.pt") and calls["n"] == 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch0001.pt"]  # no tmp
    monkeypatch.undo()
    assert train("--resume", str(out)) == 0  # once there is space
    assert (out / "checkpoints" / "epoch0003.pt").is_file()


def test_checkpoints_that_do_not_fit_the_model(tmp_path, victim, capsys):
    """Another data file (another class count) under the same run: refused, by file."""
    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.normal(size=(200, 64)), y=np.arange(200) % 10)
    run = tmp_path / "run"
    assert train("--out", str(run), "--data", str(data), "--epochs", "1", *FAST) == 0
    np.savez(data, x=rng.normal(size=(200, 64)), y=np.arange(200) % 4)  # regenerated
    before = digest(run)
    capsys.readouterr()
    assert train("--resume", str(run), "--epochs", "2") == 2
    line = one_line(capsys, "mixprec: error: ")
    assert "epoch0001.pt does not fit this model" in line and "shape" in line
    assert digest(run) == before


def test_a_checkpoint_without_model_or_with_a_negative_epoch(tmp_path, victim, capsys):
    original = torch.load(victim / "checkpoints" / "epoch0002.pt", weights_only=True)
    for key, value in (("model", None), ("epoch", -3)):
        payload = dict(original)
        if value is None:
            del payload[key]
        else:
            payload[key] = value
        line = resume_refused(victim, capsys, payload, "mixprec: error: --resume")
        assert "epoch0002.pt: not a readable checkpoint" in line
        assert (f"no {key!r} entry" if value is None else "epoch is '-3'") in line


def resume_refused(run: Path, capsys, payload: dict, start: str) -> str:
    """Both checkpoints of ``run`` replaced by ``payload``: ``--resume`` is one line
    starting with ``start``, exit 2, and the run folder stays as it was (metrics.csv
    rows kept). Returns the line."""
    for name in ("epoch0001.pt", "epoch0002.pt"):
        torch.save(payload, run / "checkpoints" / name)
    before = digest(run)
    capsys.readouterr()
    assert train("--resume", str(run), "--epochs", "3") == 2
    line = one_line(capsys, start)
    assert digest(run) == before
    return line


@pytest.mark.parametrize("fault", ["rng", "callback"])
def test_a_checkpoint_with_a_wrong_size_random_state_or_a_foreign_callback(victim, capsys, fault):
    """A random-number state of another size, or the state of a callback this run does
    not have: one line naming the file, exit 2, the run folder untouched."""
    original = torch.load(victim / "checkpoints" / "epoch0002.pt", weights_only=True)
    payload = dict(original)
    if fault == "rng":
        payload["rng"] = dict(original["rng"], torch=original["rng"]["torch"][:-8])
    else:
        payload["callbacks"] = dict(original["callbacks"], **{"EarlyStopping:0": {"wait": 1}})
    line = resume_refused(victim, capsys, payload, "mixprec: error: ")
    assert "epoch0002.pt" in line
    assert ("random-number state" if fault == "rng" else "EarlyStopping:0") in line


@pytest.mark.parametrize("damage", [b"\xff\xfe\x00garbage\n", b"epoch,step\nx,3\n"])
def test_a_damaged_metrics_csv_is_named(victim, capsys, damage):
    (victim / "metrics.csv").write_bytes(damage)
    before = digest(victim)
    capsys.readouterr()
    assert train("--resume", str(victim), "--epochs", "3") == 2
    line = one_line(capsys, "mixprec: error: ")
    assert f"{victim / 'metrics.csv'} is damaged" in line
    assert digest(victim) == before


@pytest.mark.parametrize("threads", [0, "one"])
def test_bad_values_in_config_json(victim, capsys, threads):
    config = json.loads((victim / "config.json").read_text())
    (victim / "config.json").write_text(json.dumps({**config, "threads": threads}))
    before = digest(victim)
    capsys.readouterr()
    assert train("--resume", str(victim), "--epochs", "3") == 2
    line = one_line(capsys, "mixprec: error: --resume")
    assert "config.json has threads" in line
    assert digest(victim) == before


@pytest.mark.parametrize(
    "argv,words",
    [(["--lr", "1e308"], "argument --lr: expected at most"), (["--out", ""], "expected a path")],
)
def test_extreme_options_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, argv, words
):
    monkeypatch.chdir(tmp_path)
    assert train(*argv, "--epochs", "1", *FAST) == 2
    assert words in one_line(capsys, "mixprec: error:")
    assert list(tmp_path.iterdir()) == []


SIGINT_RUN = """
import sys
from mixprec.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigint_is_one_line_exit_130_and_resumable(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-u", "-c", SIGINT_RUN, "train", "--out", str(out), "--epochs", "40",
           "--model", "mlp", "--batch-size", "32", "--threads", "1", "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # progress: one line per epoch when not on a terminal
            if "epoch 1/" in line.lower() or "1/40" in line:
                break
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().strip().splitlines()
    assert rc == 130 and len(err) == 1, err
    assert err[0].startswith("mixprec: interrupted in") and "--resume" in err[0]
    assert not list((out / "checkpoints").glob("*.tmp")) and not (out / RUN_LOCK).exists()
    done = max(int(p.stem[5:]) for p in (out / "checkpoints").glob("epoch*.pt"))
    assert train("--resume", str(out), "--epochs", str(done + 1), "--quiet") == 0


# -- (5) data in the training dtype, numeric headers -------------------------------------


def test_data_beyond_float32_is_refused(tmp_path, capsys):
    data = tmp_path / "big.csv"
    data.write_text("".join(f"{i}.5,{'1e39' if i == 3 else '2'},{i % 2}\n" for i in range(20)))
    assert train("--out", str(tmp_path / "run"), "--data", str(data), *FAST) == 2
    line = one_line(capsys, f"mixprec: error: {data}: features x hold 1e+39")
    assert "sample 3" in line and not (tmp_path / "run").exists()


def test_data_beyond_float16_is_refused_for_a_float16_level(tmp_path, capsys):
    data = tmp_path / "big.npz"
    x = np.ones((20, 3))
    x[5, 1] = 1e6
    np.savez(data, x=x, y=np.arange(20) % 2)
    argv = ["--out", str(tmp_path / "run"), "--data", str(data), "--dtype", "float16", *FAST]
    assert train(*argv) == 2
    assert "beyond float16's range" in one_line(capsys, f"mixprec: error: {data}")
    assert not (tmp_path / "run").exists()


def test_a_numeric_header_row_is_a_header_with_a_warning(tmp_path, capsys):
    data = tmp_path / "d.csv"
    rows = [",".join(str(i) for i in range(5))]
    rows += [",".join(["0.5"] * 4 + [str(i % 3)]) for i in range(30)]
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    assert train("--out", str(out), "--data", str(data), "--epochs", "1", *FAST) == 0
    assert "read as a header" in one_line(capsys, "mixprec: warning:")
    assert json.loads((out / "metrics.json").read_text())["config"]["data"] == str(data)
    payload = torch.load(out / "checkpoints" / "epoch0001.pt", weights_only=True)
    assert [v.shape[0] for k, v in payload["model"].items() if k.endswith("bias")][-1] == 3


# -- (6) strict JSON, --resume keeps compile ---------------------------------------------


def test_metrics_json_is_strict_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert train("--out", str(out), "--epochs", "1", "--lr", "3e37", *FAST) == 0
    text = (out / "metrics.json").read_text()
    metrics = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert metrics["test_loss"] is None  # NaN: the weights overflowed
    assert metrics["non_finite"]["test_loss"] == "written as null: 1 NaN"


def test_resume_keeps_compile(tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert train("--out", str(out), "--epochs", "1", *FAST) == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "compile": True}))
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(1))
    assert train("--resume", str(out), "--epochs", "2") == 0
    assert compiled and json.loads((out / "config.json").read_text())["compile"] is True


# -- (7) compare -------------------------------------------------------------------------


def test_compare_refuses_an_ineligible_fp8_entry_before_training(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--levels", "O0,O2+fp8", "--out", str(out), "--model", "lenet5",
                 "--epochs", "1", "--quiet"]) == 2  # fmt: skip
    assert "--levels O2+fp8: --fp8: no linear layer" in one_line(capsys, "mixprec: error:")
    assert not out.exists()


@pytest.mark.slow
def test_compare_reports_a_failed_level_and_runs_the_others(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "O0,O2", "--out", str(out), "--epochs", "1",
            "--dtype", "float16", "--loss-scale", "1e30", *FAST]  # fmt: skip
    assert main(argv) == 3
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: compare: 1 of 2 levels failed")
    rows = json.loads((out / "compare.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "diverged"]
    assert rows[1]["exit_code"] == 3 and "skipped" in rows[1]["reason"]
    assert "diverged (exit 3)" in captured.out
