"""``auto`` picks by the hardware: bfloat16 only on a CPU with bfloat16 units (else
float32), bfloat16 or float16 + loss scaling on CUDA by compute capability; it says which
and why in one line, and the main job notes when its bfloat16 is emulated."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from mixprec import Model, amp
from mixprec.cli import main
from mixprec.loss_scale import DynamicLossScale
from mixprec.train.models import MLP


@pytest.fixture(params=[True, False], ids=["bf16-cpu", "avx2-cpu"])
def bf16_units(request, monkeypatch):
    """Run a test as on a CPU with bfloat16 units, and as on one without: oneDNN's check
    (what mixprec asks) says so."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: request.param)
    return request.param


def test_the_cpu_check_is_onednns_own():
    level, dtype, _ = amp.choose_auto("cpu")
    assert (level, dtype) == (
        ("O1", torch.bfloat16)
        if torch.ops.mkldnn._is_mkldnn_bf16_supported()
        else ("O0", torch.float32)
    )


@pytest.mark.parametrize("fp16_units", [True, False], ids=["fp16-cpu", "no-fp16-cpu"])
def test_the_main_job_notes_emulated_float16_by_onednns_check(fp16_units, monkeypatch, tmp_path,
                                                              capsys):  # fmt: skip
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: fp16_units)
    argv = ["train", "--model", "mlp", "--epochs", "1", "--batch-size", "256", "--quiet"]
    argv += ["--device", "cpu", "--dtype", "float16", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    if fp16_units:
        assert notes == []
    else:
        assert len(notes) == 1 and "no float16 units" in notes[0] and "emulated" in notes[0]


def test_auto_on_a_cpu(bf16_units):
    level, dtype, reason = amp.choose_auto("cpu")
    if bf16_units:
        assert (level, dtype, reason) == ("O1", torch.bfloat16, "this CPU has bfloat16 units")
    else:
        assert (level, dtype) == ("O0", torch.float32)
        assert "no bfloat16 units" in reason and "emulated" in reason


@pytest.mark.parametrize(
    "capability, dtype",
    [
        ((7, 0), torch.float16),
        ((7, 5), torch.float16),
        ((8, 0), torch.bfloat16),
        ((9, 0), torch.bfloat16),
    ],
)
def test_auto_on_cuda_goes_by_compute_capability(monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    level, chosen, reason = amp.choose_auto("cuda:0")
    assert (level, chosen) == ("O2", dtype)
    assert f"{capability[0]}.{capability[1]}" in reason
    assert ("loss scaling" in reason) == (dtype == torch.float16)


def test_amp_initialize_auto_follows_the_cpu_and_logs_why(bf16_units, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    # O1 runs the model under torch.autocast(bfloat16); O0 runs it in float32.
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16_units):
        want = reference(x).float()
    assert model(x).dtype == torch.float32 and torch.equal(model(x), want)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    [record] = [r for r in caplog.records if r.name == "mixprec.amp"]
    assert record.getMessage().startswith(f"auto: level {'O1' if bf16_units else 'O0'}")
    assert not isinstance(opt.loss_scaler, DynamicLossScale)  # bf16/fp32: nothing to scale


def test_model_resolves_auto_and_says_why(bf16_units):
    net = MLP(64, hidden=(16,), num_classes=10)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = Model(net, optimizer=opt, amp_level="auto", device="cpu")
    assert (model.amp_level, model.dtype) == ("O1" if bf16_units else "O0", torch.bfloat16)
    assert "bfloat16 units" in model.auto_reason
    with pytest.raises(ValueError, match="dtype=.* with amp_level='auto'"):
        Model(MLP(64, hidden=(16,), num_classes=10), amp_level="auto", dtype="float16")


def test_the_command_says_what_auto_picked(bf16_units, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--level",
        "auto",
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--quiet",
        "--device",
        "cpu",
    ]
    assert main([*argv, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    picked = "O1, bfloat16" if bf16_units else "O0, float32"
    assert [line for line in lines if line.startswith("auto:")] == [
        f"auto: level {picked}: {amp.choose_auto('cpu')[2]}"
    ]
    assert not any(line.startswith("note:") for line in lines)  # auto never emulates
    config = json.loads((out / "config.json").read_text())
    assert config["level"] == "auto" and config["amp_level"] == picked.split(",")[0]
    assert main(["train", "--resume", str(out), "--epochs", "2", "--level", "auto"]) == 0
    assert (out / "checkpoints" / "epoch0002.pt").is_file()


def test_the_main_job_notes_emulated_bfloat16(bf16_units, tmp_path, capsys):
    # --dtype without --level trains at O2 (the default, auto, would pick float32 there).
    argv = ["train", "--model", "mlp", "--epochs", "1", "--quiet", "--device", "cpu"]
    argv += ["--dtype", "bfloat16", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("mixprec train:") and "level O2, bfloat16" in line for line in out)
    notes = [line for line in out if line.startswith("note:")]
    if bf16_units:
        assert notes == []
    else:
        assert len(notes) == 1 and "no bfloat16 units" in notes[0] and "emulated" in notes[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_this_gpu():
    capability = torch.cuda.get_device_capability()
    level, dtype, _ = amp.choose_auto("cuda")
    assert level == "O2" and dtype == (torch.bfloat16 if capability >= (8, 0) else torch.float16)
