"""Run folders cannot be mixed up or lost: --out refuses an existing run unless
--overwrite, --resume continues in its own folder (and --epochs N extends it), options
that contradict the run are refused by name, corrupt checkpoints fall back to the newest
readable one, keep_last prunes every older checkpoint, and bad output folders, run
folders of no or another format (mixprec 0.1.0's) or bad inputs are one line and exit 2
before anything is written."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import mixprec
from mixprec.cli import main
from mixprec.train.callbacks import ModelCheckpoint
from mixprec.train.data import check_arrays

FAST = ["--model", "mlp", "--batch-size", "256", "--threads", "1", "--quiet", "--device", "cpu"]


class Interrupted(Exception):
    pass


def dies_after(epoch: int):
    """``ModelCheckpoint.on_epoch_end`` that stops the run right after saving ``epoch``."""
    save = ModelCheckpoint.on_epoch_end

    def on_epoch_end(self, state):
        save(self, state)
        if state.epoch == epoch:
            raise Interrupted

    return on_epoch_end


def train(*argv: str) -> int:
    return main(["train", *argv])


def interrupted_run(monkeypatch, out: Path, after: int, *argv: str) -> None:
    monkeypatch.setattr(ModelCheckpoint, "on_epoch_end", dies_after(after))
    with pytest.raises(Interrupted):
        train(*argv)
    monkeypatch.undo()


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def csv_epochs(run: Path) -> list[int]:
    with open(run / "metrics.csv") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-epoch run: the reference every interrupted run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train("--out", str(out), "--epochs", "4", *FAST) == 0
    return out


# -- --out -------------------------------------------------------------------------------


def test_out_holding_a_run_is_refused_unless_overwrite(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = digest(run)
    assert train("--out", str(run), "--epochs", "1", *FAST) == 2
    line = one_error_line(capsys)
    assert f"--out {run} already holds a run" in line and "--overwrite" in line
    assert digest(run) == before
    (run / "notes.txt").write_text("mine")
    assert train("--out", str(run), "--epochs", "1", "--overwrite", *FAST) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch0001.pt"]
    assert csv_epochs(run) == [1]
    assert json.loads((run / "config.json").read_text())["epochs"] == 1
    assert (run / "notes.txt").read_text() == "mine"  # not a run file: left alone


@pytest.mark.parametrize("where", ["under-a-file", "proc", "read-only"])
def test_an_out_that_cannot_be_written_is_exit_2_in_one_line(tmp_path, capsys, where):
    if where == "under-a-file":
        (tmp_path / "a_file").write_text("x")
        out = tmp_path / "a_file" / "run"
    elif where == "proc":
        out = Path("/proc/mixprec-run")
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write into a read-only folder")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = locked / "run"
    assert train("--out", str(out), "--epochs", "1", *FAST) == 2
    line = one_error_line(capsys)
    assert str(out) in line or str(out.parent) in line
    assert not out.exists()


# -- --resume ----------------------------------------------------------------------------


def test_resume_continues_in_its_own_folder_from_anywhere(finished, tmp_path, monkeypatch):
    x = np.random.default_rng(0).normal(size=(200, 6)).astype(np.float32)
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    argv = ["--data", "../data/d.npz", "--out", "run", "--epochs", "3", *FAST]
    interrupted_run(monkeypatch, tmp_path / "a" / "run", 1, *argv)
    config = json.loads((tmp_path / "a" / "run" / "config.json").read_text())
    assert config["data"] == str(tmp_path / "data" / "d.npz")  # stored absolute
    monkeypatch.chdir(tmp_path / "b")
    assert train("--resume", "../a/run") == 0
    assert not (tmp_path / "b" / "runs").exists()  # nothing written into runs/train
    assert csv_epochs(tmp_path / "a" / "run") == [1, 2, 3]
    assert (tmp_path / "a" / "run" / "checkpoints" / "epoch0003.pt").is_file()


def test_resume_epochs_extends_a_finished_run_and_the_extension_resumes_exactly(
    tmp_path, monkeypatch
):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert train("--out", str(whole), "--epochs", "2", *FAST) == 0
    shutil.copytree(whole, broken)
    assert train("--resume", str(whole), "--epochs", "4") == 0
    interrupted_run(monkeypatch, broken, 3, "--resume", str(broken), "--epochs", "4")
    assert json.loads((broken / "config.json").read_text())["epochs"] == 4
    assert train("--resume", str(broken)) == 0  # the folder now says 4 epochs
    assert_same_weights(
        whole / "checkpoints" / "epoch0004.pt", broken / "checkpoints" / "epoch0004.pt"
    )
    assert csv_epochs(broken) == [1, 2, 3, 4]
    losses = json.loads((whole / "metrics.json").read_text())["history"]["epochs"]["loss"]
    assert len(losses) == 4 and losses[3] < losses[1]  # the extension really trained


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--lr", "0.5"),
        ("--model", "lenet5"),
        ("--batch-size", "64"),
        ("--seed", "3"),
        ("--level", "O1"),
        ("--dtype", "float16"),
        ("--loss-scale", "1024"),
        ("--data", "{tmp}/other.npz"),
        ("--out", "{tmp}/elsewhere"),
        ("--overwrite", None),
    ],
)
def test_an_option_that_contradicts_the_resumed_run_is_refused_by_name(
    finished, tmp_path, capsys, flag, value
):
    before = digest(finished)
    extra = [flag] if value is None else [flag, value.format(tmp=tmp_path)]
    assert train("--resume", str(finished), *extra) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"mixprec: error: {flag} ") and "contradicts" in line
    assert digest(finished) == before


def test_options_that_agree_with_the_resumed_run_are_accepted(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    assert train("--resume", str(run), "--lr", "0.01", "--model", "mlp", "--batch-size", "256") == 0
    assert train("--resume", str(run), "--epochs", "3") == 2  # fewer than it has done


def test_a_corrupt_newest_checkpoint_falls_back_with_one_warning(
    finished, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    interrupted_run(monkeypatch, run, 3, "--out", str(run), "--epochs", "4", *FAST)
    newest = run / "checkpoints" / "epoch0003.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    capsys.readouterr()
    assert train("--resume", str(run)) == 0
    io = capsys.readouterr()
    warning = io.err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("mixprec: warning: ")
    assert str(newest) in warning[0] and "resuming from epoch0002.pt" in warning[0]
    assert "from epoch0002.pt (epoch 2)" in io.out
    assert_same_weights(
        finished / "checkpoints" / "epoch0004.pt", run / "checkpoints" / "epoch0004.pt"
    )
    assert csv_epochs(run) == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "epoch0003.pt",
        "epoch0004.pt",
    ]


def test_no_readable_checkpoint_is_exit_2_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    interrupted_run(monkeypatch, run, 2, "--out", str(run), "--epochs", "4", *FAST)
    for path in (run / "checkpoints").iterdir():
        path.write_bytes(b"")
    before = digest(run)
    assert train("--resume", str(run)) == 2
    line = one_error_line(capsys)
    assert f"--resume {run}: no readable checkpoint" in line
    assert digest(run) == before  # config.json and metrics.csv untouched


@pytest.mark.parametrize("fmt", [None, "mixprec-run-0"], ids=["no format", "another format"])
def test_a_run_folder_of_no_or_another_format_is_refused_in_one_line(
    finished, tmp_path, capsys, fmt
):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    config = json.loads((run / "config.json").read_text())
    written = config.pop("format")  # the format this version writes; 0.1.0 wrote none
    if fmt is not None:
        config["format"] = fmt
    (run / "config.json").write_text(json.dumps(config))
    before = digest(run)
    assert train("--resume", str(run)) == 2
    line = one_error_line(capsys)
    found = "no format" if fmt is None else f"format {fmt!r}"
    assert f"--resume {run}: its config.json has {found}; " in line
    assert f"reads {written!r}" in line
    assert digest(run) == before


def test_keep_last_prunes_every_older_checkpoint(finished, tmp_path, monkeypatch):
    run = tmp_path / "run"
    interrupted_run(monkeypatch, run, 2, "--out", str(run), "--epochs", "4", *FAST)
    # Checkpoints a killed run (or an older mixprec) left behind, beyond keep_last.
    for name in ("epoch0000.pt", "epoch0001.pt"):
        shutil.copy(run / "checkpoints" / "epoch0002.pt", run / "checkpoints" / name)
    assert train("--resume", str(run)) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "epoch0003.pt",
        "epoch0004.pt",
    ]
    assert_same_weights(
        finished / "checkpoints" / "epoch0004.pt", run / "checkpoints" / "epoch0004.pt"
    )


# -- inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("lr", ["inf", "nan", "-1", "0"])
def test_the_learning_rate_must_be_positive_and_finite(tmp_path, capsys, lr):
    assert train("--out", str(tmp_path / "run"), "--lr", lr) == 2
    assert "--lr" in one_error_line(capsys) and not (tmp_path / "run").exists()


def test_a_label_far_beyond_the_samples_is_an_error_naming_it(tmp_path, capsys):
    x = np.random.default_rng(0).normal(size=(120, 4)).astype(np.float32)
    y = np.arange(120) % 3
    y[17] = 1_000_000
    np.savez(tmp_path / "ids.npz", x=x, y=y)
    assert train("--data", str(tmp_path / "ids.npz"), "--out", str(tmp_path / "run")) == 2
    line = one_error_line(capsys)
    assert "label 1000000 (at sample 17)" in line and "ids.npz" in line
    assert not (tmp_path / "run").exists()
    # Up to max(1000, 2 x samples) classes pass; naming num_classes lifts the limit.
    y[17] = 999
    assert int(check_arrays(x, y)[1].max()) == 999
    y[17] = 1_000_000
    assert int(check_arrays(x, y, num_classes=1_000_001)[1].max()) == 1_000_000


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"mixprec {mixprec.__version__} (torch {torch.__version__})"
    )
