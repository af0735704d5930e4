"""``--optimizer adamw8bit`` on the command line: ``mixprec train`` records it, resumes
with it bit for bit and refuses another optimizer on resume; ``mixprec compare`` takes
it per entry (``O2+split8+adamw8bit``) or for every entry; a bad value exits 2."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli_master_weights import FAST, TINY, one_line

from mixprec.cli import main


def test_train_adamw8bit_records_it_and_resumes_exactly(capsys, full_and_interrupted):
    full, part, printed = full_and_interrupted(["--level", "O2", "--master-weights", "split8",
                                                "--optimizer", "adamw8bit", *TINY,
                                                "--epochs", "3", *FAST])  # fmt: skip
    assert "master weights split8, optimizer adamw8bit" in printed
    assert main(["train", "--resume", str(part), "--optimizer", "adamw", *FAST]) == 2
    assert one_line(capsys).startswith(
        f"mixprec: error: --optimizer adamw contradicts the run in {part} (optimizer adamw8bit)"
    )
    assert main(["train", "--resume", str(part), *FAST]) == 0
    for run in (full, part):
        assert json.loads((run / "config.json").read_text())["optimizer"] == "adamw8bit"
    a = torch.load(full / "checkpoints" / "epoch0003.pt", weights_only=False)
    b = torch.load(part / "checkpoints" / "epoch0003.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    states = a["optimizer"]["state"].values()
    assert states and all(s["exp_avg_q"].dtype == torch.int8 for s in states)
    assert all(s["exp_avg_sq_q"].dtype == torch.uint8 for s in states)
    for i, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][i][key]), (i, key)
    assert json.loads((full / "metrics.json").read_text())["test_accuracy"] > 0.85


def test_a_run_from_before_the_option_resumes_with_torchs_adamw(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, "--epochs", "1", *FAST]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config.pop("optimizer") == "adamw"
    (out / "config.json").write_text(json.dumps(config))  # as written before the option
    assert main(["train", "--resume", str(out), "--epochs", "2", *FAST]) == 0
    checkpoint = torch.load(out / "checkpoints" / "epoch0002.pt", weights_only=False)
    state = next(iter(checkpoint["optimizer"]["state"].values()))
    assert state["exp_avg"].dtype == torch.float32  # torch's AdamW state
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--optimizer", "adamw8bit", *FAST]) == 2
    assert "contradicts the run" in one_line(capsys)


@pytest.mark.parametrize("level", ["lean", "O3", "O0"])
def test_adamw8bit_trains_at_other_levels(level, tmp_path):
    out = tmp_path / level
    argv = ["train", "--out", str(out), "--level", level, "--optimizer", "adamw8bit", *TINY,
            "--epochs", "2", *FAST]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out / "metrics.json").read_text())["test_accuracy"] > 0.75


@pytest.mark.slow  # a compare run per entry; test_cli covers compare by default
def test_compare_takes_adamw8bit_per_entry(tmp_path):
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "O2+split8,O2+split8+adamw8bit", *TINY, "--epochs", "2",
            "--out", str(out), *FAST]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["config"] for r in rows] == [
        "O2 bfloat16 masters-split8", "O2 bfloat16 masters-split8 adamw8bit"
    ]
    assert abs(rows[0]["accuracy"] - rows[1]["accuracy"]) <= 0.05


@pytest.mark.parametrize("command", ["train", "compare"])
def test_an_unknown_optimizer_exits_2_with_one_line(command, tmp_path, capsys):
    out = tmp_path / "x"
    assert main([command, "--out", str(out), "--optimizer", "sgd", *FAST]) == 2
    assert "argument --optimizer: invalid choice: 'sgd'" in one_line(capsys)
    assert not out.exists()
