"""``mixprec compare`` (issues 29 and 32): a stuck level is stopped by ``--level-timeout``
and reported, a level whose process dies is seen at once, the others still run; progress lines (level i/N, elapsed, ETA); its own
``--help``; ``compare.png`` with a title, values and a memory panel.

The levels here are stand-ins (``level_target`` replaced by functions of this module,
which the spawned level processes import): what is tested is the parent's handling of
its children, not training.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import time

import pytest

import mixprec.cli._compare as compare
from mixprec.cli import main
from mixprec.train import plot_comparison, read_plot_data

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="spawned level processes")

ARGS = ["--model", "mlp", "--epochs", "1", "--threads", "1", "--device", "cpu"]


def row(entry: str) -> dict:
    return {"config": entry, "accuracy": 0.5, "loss": 1.0, "step_ms": 2.0, "peak_mb": 100.0,
            "skipped_steps": 0}  # fmt: skip


def hangs(args, entry):
    """Alive but stuck: never answers."""
    time.sleep(600)


def o2_hangs(args, entry):
    if entry == "O2":
        hangs(args, entry)
    return row(entry)


def test_run_level_stops_a_stuck_level_at_its_timeout():
    t0 = time.perf_counter()
    status, reason, code = compare.run_level(None, "O2", target=hangs, timeout_s=1.0)
    assert (status, code) == ("timeout", 1)
    assert reason == "still running after 1 s (--level-timeout): stopped"
    assert time.perf_counter() - t0 < 60
    assert multiprocessing.active_children() == []  # stopped and reaped, not orphaned


def dies(args, entry):
    """A level whose process dies at once (as a torch segfault would)."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_run_level_sees_a_dead_level_process():
    t0 = time.perf_counter()
    status, reason, code = compare.run_level(None, "O2", target=dies)
    assert (status, code) == ("failed", 1) and "killed by SIGKILL" in reason
    assert time.perf_counter() - t0 < 30


@pytest.mark.slow  # three level processes (each imports torch), one waited on for 30 s
def test_a_stuck_level_is_a_row_the_others_run_and_the_exit_is_non_zero(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(compare, "level_target", o2_hangs)
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "O0,O2,O1", "--level-timeout", "30", "--out", str(out), *ARGS]
    assert main(argv) == 1
    captured = capsys.readouterr()
    rows = json.loads((out / "compare.json").read_text())
    assert [(r["entry"], r["status"]) for r in rows] == [("O0", "ok"), ("O2", "timeout"),
                                                         ("O1", "ok")]  # fmt: skip
    assert rows[1]["reason"] == "still running after 30 s (--level-timeout): stopped"
    assert rows[1]["exit_code"] == 1
    assert "O2                         timeout (exit 1): still running after 30 s" in captured.out
    err = captured.err.splitlines()
    assert err[-1].startswith("mixprec: error: compare: 1 of 3 levels failed, first O2: timeout")
    # Progress: a line as each level starts and ends, with i/N, elapsed time and ETA.
    progress = [line for line in err if line.startswith("  [")]
    assert len(progress) == 6, err
    assert re.fullmatch(r"  \[1/3\] O0: started \(elapsed \d+ s, ETA unknown\)", progress[0])
    assert re.fullmatch(r"  \[1/3\] O0: O0 in \d+\.\d s \(elapsed \d+ s, ETA \d+ s\)", progress[1])
    assert re.fullmatch(r"  \[2/3\] O2: started \(elapsed \d+ s, ETA \d+ s\)", progress[2])
    assert re.fullmatch(
        r"  \[2/3\] O2: timeout: still running after 30 s \(--level-timeout\): stopped in "
        r"\d+\.\d s \(elapsed \d+ s, ETA \d+ s\)",
        progress[3],
    )
    assert progress[5].startswith("  [3/3] O1: O1 in ") and progress[5].endswith("ETA 0 s)")
    assert multiprocessing.active_children() == []


def test_progress_lines_count_levels_and_estimate_the_rest(monkeypatch, capsys):
    # Made, then per level: its start, the line's elapsed; its end, the line's elapsed.
    clock = iter([0.0, 0.0, 0.0, 10.0, 10.0, 10.0, 10.0, 30.0, 30.0])
    monkeypatch.setattr(compare.time, "perf_counter", lambda: next(clock))
    progress = compare._Progress(2, quiet=False)
    progress.start(1, "O0")
    progress.end(1, "O0", "O0")
    progress.start(2, "O2")
    progress.end(2, "O2", "O2 bfloat16")
    assert capsys.readouterr().err.splitlines() == [
        "  [1/2] O0: started (elapsed 0 s, ETA unknown)",
        "  [1/2] O0: O0 in 10.0 s (elapsed 10 s, ETA 10 s)",
        "  [2/2] O2: started (elapsed 10 s, ETA 10 s)",
        "  [2/2] O2: O2 bfloat16 in 20.0 s (elapsed 30 s, ETA 0 s)",
    ]
    monkeypatch.setattr(compare.time, "perf_counter", lambda: 0.0)
    quiet = compare._Progress(2, quiet=True)
    quiet.start(1, "O0")
    assert capsys.readouterr().err == ""


def test_compare_help_is_its_own(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--resume" not in text and "--level auto" not in text  # train's, not compare's
    assert "--level-timeout SECONDS" in text and "--levels LEVELS" in text
    assert "several amp levels" in text and "compare.json" in text
    assert "(default: 15, for each level)" in text


def test_compare_png_has_a_title_values_and_a_memory_panel(tmp_path, monkeypatch):
    import matplotlib.axes

    labels: list[list[str]] = []
    real = matplotlib.axes.Axes.bar_label

    def bar_label(self, container, **kwargs):
        labels.append(list(kwargs["labels"]))
        return real(self, container, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar_label", bar_label)
    rows = [row("O0"), {**row("O2 bfloat16"), "accuracy": 0.9375, "step_ms": 1.25,
                        "peak_mb": 80.0}]  # fmt: skip
    path = tmp_path / "compare.png"
    plot_comparison(rows, path, title="mixprec compare: mlp on digits, 1 epoch, cpu")
    assert labels == [["0.500", "0.938"], ["2.00", "1.25"], ["100", "80"]]
    data = read_plot_data(path)
    assert data["title"] == "mixprec compare: mlp on digits, 1 epoch, cpu"
    assert [r["peak_mb"] for r in data["rows"]] == [100.0, 80.0]
