"""``--master-weights`` on the command line: ``mixprec train`` records the mode, resumes
with it bit for bit, and refuses a mode its level or dtype cannot take before writing
anything; ``mixprec compare`` takes a mode per entry (``O2+split8``) or for every entry."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec.cli import build_parser, main
from mixprec.optim.masters import MASTER_WEIGHT_MODES

FAST = ["--quiet", "--threads", "1"]
#: Tiny runs: the MLP, 11 steps an epoch. bfloat16 named, so a CUDA machine (float16 by
#: default) runs the same configurations.
TINY = ["--model", "mlp", "--batch-size", "128", "--dtype", "bfloat16"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_choices_are_the_librarys_modes():
    """The parser spells the modes itself (it loads without torch): ``none`` is False."""
    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    choices = next(a for a in train._actions if a.dest == "master_weights").choices
    cli = tuple(False if mode == "none" else mode for mode in choices)
    assert sorted(map(str, cli)) == sorted(map(str, MASTER_WEIGHT_MODES))


def test_train_split8_records_the_mode_and_resumes_exactly(capsys, full_and_interrupted):
    """``--level O2 --master-weights split8``: config.json says so, the checkpoints hold
    the 8-bit corrections, and a run that dies after epoch 2 and resumes ends with the
    uninterrupted run's weights and corrections. Resuming with another mode is refused."""
    common = ["--level", "O2", "--master-weights", "split8", *TINY, "--epochs", "3", *FAST]
    full, part, printed = full_and_interrupted(common)
    assert "master weights split8" in printed
    assert main(["train", "--resume", str(part), "--master-weights", "kahan", *FAST]) == 2
    assert one_line(capsys).startswith(
        f"mixprec: error: --master-weights kahan contradicts the run in {part} "
        "(master_weights split8)"
    )
    # The run's own mode, given again, agrees with it.
    assert main(["train", "--resume", str(part), "--master-weights", "split8", *FAST]) == 0
    assert "from epoch0002.pt (epoch 2)" in capsys.readouterr().out
    for run in (full, part):
        assert json.loads((run / "config.json").read_text())["master_weights"] == "split8"
        assert json.loads((run / "metrics.json").read_text())["config"]["master_weights"] == (
            "split8"
        )
    a = torch.load(full / "checkpoints" / "epoch0003.pt", weights_only=False)
    b = torch.load(part / "checkpoints" / "epoch0003.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    masters_a = a["optimizer"]["mixprec"]["master"]
    masters_b = b["optimizer"]["mixprec"]["master"]
    assert masters_a["mode"] == masters_b["mode"] == "split8"
    corrections = masters_a["corrections"]
    assert corrections and all(c.dtype == torch.int8 for c in corrections)
    assert any(c.abs().sum() > 0 for c in corrections)  # they hold something
    assert len(corrections) == len(masters_b["corrections"])
    for u, v in zip(corrections, masters_b["corrections"]):
        assert torch.equal(u, v)
    assert json.loads((full / "metrics.json").read_text())["test_accuracy"] > 0.85


def test_train_without_the_option_records_the_levels_own(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, "--epochs", "1", *FAST]) == 0
    assert json.loads((out / "config.json").read_text())["master_weights"] is None
    checkpoint = torch.load(out / "checkpoints" / "epoch0001.pt", weights_only=False)
    masters = checkpoint["optimizer"]["mixprec"]["master"]
    assert list(masters) == ["masters"]  # O2's own: float32 copies ("fp32" names no mode)
    assert all(m.dtype == torch.float32 for m in masters["masters"])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--level", "O1", "--master-weights", "split8"], ["level='O1'", "use O2, O3 or lean"]),
        (["--level", "rewrite", "--master-weights", "split"], ["'rewrite'", "float32"]),
        (["--dtype", "float16", "--master-weights", "split8"], ["bfloat16", "float16"]),
        (["--level", "O0", "--master-weights", "kahan"], ["level='O0'", "use O2, O3 or lean"]),
        # On a CPU auto picks O1 (bfloat16 units) or O0: neither keeps masters.
        (
            ["--device", "cpu", "--level", "auto", "--master-weights", "stochastic"],
            ["--level auto", "use O2, O3 or lean"],
        ),
    ],
    ids=["O1-split8", "rewrite-split", "float16-split8", "O0-kahan", "auto-stochastic"],
)
def test_train_refuses_a_mode_its_level_or_dtype_cannot_take(argv, words, tmp_path, capsys):
    """Exit 2, one line naming the option, its value and the fix; no folder is created."""
    out = tmp_path / "deep" / "run"
    assert main(["train", "--out", str(out), *argv, *FAST]) == 2
    line = one_line(capsys)
    assert line.startswith(f"mixprec: error: --master-weights {argv[-1]}"), line
    for word in words:
        assert word in line, (word, line)
    assert list(tmp_path.iterdir()) == []


def test_train_master_weights_none_is_stepped_as_it_is(tmp_path):
    """``none`` is ``master_weights=False``: lean without its compensation buffers."""
    out = tmp_path / "run"
    argv = ["--level", "lean", "--master-weights", "none", *TINY, "--epochs", "1", *FAST]
    assert main(["train", "--out", str(out), *argv]) == 0
    assert json.loads((out / "config.json").read_text())["master_weights"] == "none"
    checkpoint = torch.load(out / "checkpoints" / "epoch0001.pt", weights_only=False)
    assert checkpoint["optimizer"]["mixprec"]["master"] is None


@pytest.mark.slow  # a compare run per entry; test_cli covers compare by default
def test_compare_entries_carry_a_mode(tmp_path, capsys):
    """``O2+split8`` beside ``O2``: rows keep the entry as written, the config names the
    mode; split8 steps as float32 masters do, so the two end close."""
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "O2,O2+split8", *TINY, "--epochs", "2", "--out", str(out)]
    assert main([*argv, *FAST]) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["entry"] for r in rows] == ["O2", "O2+split8"]
    assert [r["config"] for r in rows] == ["O2 bfloat16", "O2 bfloat16 masters-split8"]
    assert abs(rows[0]["accuracy"] - rows[1]["accuracy"]) <= 0.03
    table = capsys.readouterr().out.splitlines()
    # The config column widens to the longest config: the numbers stay in their columns.
    header, row = table[0], table[3]
    assert header.index("accuracy") + 8 == row.index(f"{rows[1]['accuracy']:.4f}") + 6


@pytest.mark.parametrize(
    ("levels", "more", "start"),
    [
        ("O2,O1+split8", [], "--levels O1+split8: master_weights='split8' with level='O1'"),
        ("O2,O1", ["--master-weights", "split8"], "--levels O1 with --master-weights split8:"),
        ("O2,O2+split8+kahan", [], "--levels: 'O2+split8+kahan' names 2 master-weight modes"),
        ("O2+fp16", [], "--levels: unknown option 'fp16' in 'O2+fp16'"),
    ],
)
def test_compare_refuses_a_bad_entry_before_any_trains(levels, more, start, tmp_path, capsys):
    """Not quiet: a level that started would print its progress line on stderr."""
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", levels, *more, *TINY, "--out", str(out), "--threads", "1"]
    assert main(argv) == 2
    line = one_line(capsys)  # the error alone
    assert line.startswith(f"mixprec: error: {start}"), line
    assert not out.exists()


@pytest.mark.parametrize(
    "options, eps",
    [
        (["--level", "O3"], 1e-4),
        (["--level", "lean"], 1e-4),
        (["--level", "O2", "--master-weights", "none"], 1e-4),
        (["--level", "O2"], 1e-8),  # float32 masters: float32 state
    ],
    ids=["O3", "lean", "O2-none", "O2"],
)
def test_float16_optimizer_state_gets_an_eps_it_can_hold(options, eps, tmp_path, capsys):
    """The command has no eps option, and AdamW's default 1e-8 rounds to 0 in float16
    state, which amp.initialize refuses: levels that keep the state in float16 train
    with 1e-4, and say so."""
    tiny = ["--model", "mlp", "--batch-size", "256", "--dtype", "float16", "--epochs", "1"]
    assert main(["train", *options, *tiny, *FAST, "--out", str(tmp_path / "run")]) == 0
    note = "note: AdamW eps 0.0001, not 1e-08"
    assert (note in capsys.readouterr().out) == (eps == 1e-4)
    saved = torch.load(tmp_path / "run" / "checkpoints" / "epoch0001.pt", weights_only=False)
    assert [group["eps"] for group in saved["optimizer"]["param_groups"]] == [eps]


@pytest.mark.slow  # a compare run per entry; test_cli covers compare by default
def test_compare_names_the_rows_that_train_with_the_float16_state_eps(tmp_path):
    """A ``mixprec compare`` row whose level took eps=1e-4 says so, so the table does not
    credit the level with what the other eps did."""
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "O2,O3", "--model", "mlp", "--batch-size", "256",
            "--dtype", "float16", "--epochs", "1", *FAST, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["config"] for r in rows] == ["O2 float16", "O3 float16 eps-0.0001"]

