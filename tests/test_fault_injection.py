"""Fault injection: inf/NaN at chosen steps, SIGKILL of the training process mid-epoch or
mid-checkpoint-write, a corrupted newest checkpoint; after resuming (or starting over
where no checkpoint survived) the final weights, optimizer and loss-scale state, random
state and history always equal an uninterrupted run's, bit for bit (CPU, one thread),
and no epoch is lost or doubled.

This file is also the child process: ``python test_fault_injection.py SPEC`` runs
``mixprec train`` with the faults ``SPEC`` describes. The default suite runs one
scenario; ``-m slow`` sweeps :data:`SWEEP_SEEDS` seeded scenarios.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

EPOCHS = 4
STEPS_PER_EPOCH = 11  # 1,293 training digits (145 more validate) in batches of 128
ARGS = ["--model", "mlp", "--batch-size", "128", "--threads", "1", "--quiet", "--device", "cpu"]
SWEEP_SEEDS = range(24)


# -- the child: mixprec train with faults --------------------------------------------------


def install_faults(faults: dict[str, Any], patch=setattr) -> None:
    """Patch this process's ``mixprec train`` (through ``patch(obj, name, value)``): inject
    inf/NaN into chosen batches, and SIGKILL it at a chosen training step or in the middle
    of a chosen checkpoint write."""
    from mixprec.train.models import MLP  # what --model mlp trains

    inject, calls = faults.get("inject"), [0]
    kill_step, kill_save = faults.get("kill_step"), faults.get("kill_save")

    def hook(module, args, out):
        if not module.training:
            return out
        calls[0] += 1
        if calls[0] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        # Which batches are hit depends only on their content, so a resumed run hits the
        # same ones as an uninterrupted run.
        if inject and int(args[0].double().sum().item()) % inject["modulus"] in inject["hits"]:
            if inject["kind"] == "nan":
                return out * math.nan  # a NaN loss; its gradients are NaN too
            out.register_hook(lambda grad: grad * math.inf)  # finite loss, inf gradients
        return out

    forward = MLP.forward

    def forward_with_faults(self, x):
        return hook(self, (x,), forward(self, x))

    patch(MLP, "forward", forward_with_faults)
    if kill_save:
        save, saves = torch.save, [0]

        def save_then_die(obj, f, *args, **kwargs):
            saves[0] += 1
            if saves[0] != kill_save:
                return save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        patch(torch, "save", save_then_die)


def run_child(argv: list[str], faults: dict[str, Any]) -> subprocess.CompletedProcess:
    spec = json.dumps({"argv": argv, "faults": faults})
    return subprocess.run(
        [sys.executable, __file__, spec],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


# -- comparing runs ------------------------------------------------------------------------


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal, recursively: tensors bit for bit, floats with NaN equal to NaN."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) or (
            a.is_floating_point()
            and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        ), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def final_state(run: Path) -> dict[str, Any]:
    return torch.load(run / "checkpoints" / f"epoch{EPOCHS:04d}.pt", weights_only=True)


def assert_matches(run: Path, reference: Path) -> None:
    mine, ref = final_state(run), final_state(reference)
    for key in ("model", "optimizer", "rng", "epoch", "step", "callbacks"):
        same(mine[key], ref[key], key)
    with open(run / "metrics.csv") as f:
        assert [line.split(",")[0] for line in f.read().splitlines()[1:]] == [
            str(e) for e in range(1, EPOCHS + 1)
        ]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [f"epoch{EPOCHS - 1:04d}.pt", f"epoch{EPOCHS:04d}.pt"], names
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == EPOCHS * STEPS_PER_EPOCH


def reference_run(out: Path, inject: dict[str, Any]) -> Path:
    """The uninterrupted run with the same injected inf/NaN (in this process: the
    children must match it bit for bit all the same)."""
    from mixprec.cli import main

    with pytest.MonkeyPatch.context() as monkeypatch:
        install_faults({"inject": inject}, monkeypatch.setattr)
        assert main(["train", "--out", str(out), "--epochs", str(EPOCHS), *ARGS]) == 0
    skipped = json.loads((out / "metrics.json").read_text())["history"]["skipped"]
    assert any(skipped), "the injection never fired"
    return out


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    damaged = {
        "truncate": data[: len(data) // 3],
        "garbage": random.Random(len(data)).randbytes(len(data)),
        "empty": b"",
    }[how]
    path.write_bytes(damaged)


def resume_until_done(run: Path, inject: dict | None, later_kill: dict | None) -> list[str]:
    """Resume (killed again if ``later_kill``) until the run finishes; what happened."""
    events = []
    for _ in range(4):
        faults = {"inject": inject, **(later_kill or {})}
        later_kill = None
        proc = run_child(["train", "--resume", str(run)], faults)
        if proc.returncode == -signal.SIGKILL:
            events.append("killed again")
            continue
        if proc.returncode == 2 and "no readable checkpoint" in proc.stderr:
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
            events.append("nothing to resume: start over")
            argv = ["train", "--out", str(run), "--overwrite", "--epochs", str(EPOCHS), *ARGS]
            proc = run_child(argv, {"inject": inject})
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if line]
        assert len(warnings) <= 1 and all(w.startswith("mixprec: warning:") for w in warnings)
        events.append("resumed" + (" past a corrupt checkpoint" if warnings else ""))
        return events
    raise AssertionError(f"never finished: {events}")


def scenario(tmp: Path, seed: int) -> list[str]:
    """One seeded scenario; returns what happened, for the report."""
    rng = random.Random(seed)
    inject = {
        "kind": rng.choice(["nan", "inf_grad"]),
        "modulus": 7,
        "hits": rng.sample(range(7), rng.choice([1, 2])),
    }
    reference = reference_run(tmp / "reference", inject)
    run = tmp / "run"

    def a_kill() -> dict[str, int]:
        # Mostly after the first checkpoint, so that most scenarios resume, some start over.
        later = rng.random() < 0.8
        if rng.random() < 0.5:
            first = STEPS_PER_EPOCH + 1 if later else 1
            return {"kill_step": rng.randrange(first, EPOCHS * STEPS_PER_EPOCH)}
        return {"kill_save": rng.randrange(2, EPOCHS + 1) if later else 1}

    first = a_kill()
    proc = run_child(
        ["train", "--out", str(run), "--epochs", str(EPOCHS), *ARGS], {"inject": inject, **first}
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    events = [f"{inject['kind']} at {inject['hits']} mod 7, killed {first}"]
    checkpoints = sorted((run / "checkpoints").glob("epoch*.pt"))
    if checkpoints and rng.random() < 0.5:
        how = rng.choice(["truncate", "garbage", "empty"])
        corrupt(checkpoints[-1], how)
        events.append(f"{how} {checkpoints[-1].name}")
    events += resume_until_done(run, inject, a_kill() if rng.random() < 0.4 else None)
    assert_matches(run, reference)
    return events


def test_kill_mid_checkpoint_write_and_a_corrupt_newest_checkpoint(tmp_path):
    inject = {"kind": "nan", "modulus": 7, "hits": [3]}
    reference = reference_run(tmp_path / "reference", inject)
    run = tmp_path / "run"
    argv = ["train", "--out", str(run), "--epochs", str(EPOCHS), *ARGS]
    proc = run_child(argv, {"inject": inject, "kill_save": 3})  # dies writing epoch 3
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[1:] == ["epoch0001.pt", "epoch0002.pt"]
    assert re.fullmatch(r"\.epoch0003\.pt\.\d+\.\d+\.tmp", names[0])  # per process
    corrupt(run / "checkpoints" / "epoch0002.pt", "truncate")
    assert resume_until_done(run, inject, None) == ["resumed past a corrupt checkpoint"]
    assert not list((run / "checkpoints").glob("*.tmp"))  # the dead process's, removed
    assert_matches(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_fault_injection_sweep(tmp_path, seed, record_property):
    events = scenario(tmp_path, seed)
    record_property("scenario", "; ".join(events))  # in --junitxml's report, not the output


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    install_faults(spec["faults"])
    from mixprec.cli import main

    sys.exit(main(spec["argv"]))
