"""`mixprec diagnose`: the table, precision_report.json and the PNG for the main job's
models and data, and one-line errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from mixprec.cli import main
from mixprec.diagnostics import PrecisionReport

FAST = ["--threads", "1", "--batches", "2"]


@pytest.mark.parametrize("model", ["lenet5", "mlp", "transformer"])
def test_diagnose_writes_the_table_json_and_png(tmp_path, capsys, model):
    out = tmp_path / "diag"
    assert main(["diagnose", "--model", model, "--out", str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    assert f"mixprec diagnose: {model} on digits, 2 batch(es) of 32" in printed
    assert "loss scale: recommended 2^" in printed and "under@2^" in printed
    assert (out / "precision_report.txt").read_text().strip() in printed
    report = PrecisionReport.load(out / "precision_report.json")
    assert report.dtype.is_floating_point and str(report.dtype) == "torch.float16"
    assert report.batches == 2 and len(report.layers) > 5
    assert f"{report.recommended_loss_scale:g}" in printed
    pixels = imread(out / "precision_report.png")
    assert pixels.ndim == 3 and pixels.shape[0] > 200


def test_diagnose_reads_a_data_file_and_another_dtype(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.random((40, 64)).astype(np.float32) * 6e4  # raw counts: out of float16's range
    path = tmp_path / "raw.npz"
    np.savez(path, x=x, y=np.arange(40) % 4)
    out = tmp_path / "diag"
    args = ["diagnose", "--model", "mlp", "--data", str(path), "--out", str(out), *FAST]
    assert main([*args, "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert f"on {path}" in printed and "keep in float32: layers.1" in printed
    data = json.loads((out / "precision_report.json").read_text())
    assert "layers.1" in data["at_risk"]
    assert main([*args, "--dtype", "bfloat16", "--overwrite"]) == 0
    assert "at risk under any single scale: none" in capsys.readouterr().out
    assert PrecisionReport.load(out).dtype == torch.bfloat16  # the old report replaced


def test_a_folder_holding_a_report_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "diag"
    assert main(["diagnose", "--out", str(out), *FAST]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # Refused, as train refuses a run folder; and a bad option is named before the folder.
    assert main(["diagnose", "--out", str(out), *FAST, "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a report (precision_report.txt" in err
    assert "--overwrite" in err
    assert main(["diagnose", "--out", str(out), *FAST, "--data", "missing.npz"]) == 2
    assert "missing.npz" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_report_says_why_a_large_under_column_is_not_at_risk(tmp_path, capsys):
    assert main(["diagnose", "--out", str(tmp_path / "d"), *FAST, "--model", "lenet5"]) == 0
    report = PrecisionReport.load(tmp_path / "d")
    lines = report.summary_lines()
    # A tensor over the tolerance in the "under" column but not at risk is named, with why.
    over = [(n, t) for n, layer in report.layers.items() for t, c in layer.tensors.items()
            if "grad" not in t and c.underflow_fraction(report.dtype) > report.tolerance
            and (n, t) not in report.risky_tensors]  # fmt: skip
    explained = [line for line in lines if line.startswith("not at risk, though over")]
    assert over and "subnormal in float16, not zero" in explained[0]  # LeNet-5's logits
    assert all(f"{name} {tensor} " in explained[0] for name, tensor in over)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batches", "0"], "argument --batches: expected a positive"),
        (["--dtype", "float32"], "argument --dtype: invalid choice"),
        (["--tolerance", "2"], "tolerance must be a number in [0, 1]"),
        (["--data", "missing.npz"], "missing.npz"),
        (["--model", "resnet"], "argument --model: invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, args, message):
    out = tmp_path / "diag"
    assert main(["diagnose", "--out", str(out), *FAST, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mixprec: error:") and message in err
    assert not out.exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["diagnose", "--out", str(target), *FAST]) == 2
    assert "is a file" in capsys.readouterr().err and target.read_text() == "x"
