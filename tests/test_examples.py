"""Every script in examples/ runs: a few steps each, on the CPU, in seconds.

The scripts run in this process (their ``main(argv)``), in a temporary folder, with
``--steps 2``; the FSDP2 one runs under ``torchrun`` with 2 gloo ranks on 127.0.0.1 at a
free port, in a subprocess bounded in time.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.tools import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: script -> its extra arguments for a smoke run (beyond ``--steps 2``)
IN_PROCESS = {
    "gpt2_char.py": ["--length", "16", "--batch-size", "4"],
    "resnet_digits.py": ["--eval-batches", "1"],
    "accelerate_digits.py": ["--out", "runs/accelerate"],
    "diagnostics_float16.py": [],  # its default: a fresh folder under runs/
    "lightning_resnet.py": ["--out", "runs/lightning"],
    "hf_trainer_gpt2.py": ["--out", "runs/hf"],
}
#: Trainers' start-up alone takes seconds.
SLOW = {"lightning_resnet.py", "hf_trainer_gpt2.py", "diagnostics_float16.py"}
UNDER_TORCHRUN = {"fsdp2_torchrun.py"}


def test_every_example_is_smoke_tested():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(IN_PROCESS) | UNDER_TORCHRUN


def load(script: str):
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", EXAMPLES / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in IN_PROCESS],
)
def test_example_runs_a_few_steps(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # an example may add its folder
    assert load(script).main(["--steps", "2", *IN_PROCESS[script]]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out or "accuracy" in out, out


@pytest.mark.slow
def test_fsdp2_example_under_torchrun_with_two_ranks(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(EXAMPLES / "fsdp2_torchrun.py"), "--steps", "2", "--length", "16",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks, 2 steps, skipped 0" in done.stdout
