"""Checkpoints cannot run code: every load is weights-only, and a file that would need
arbitrary unpickling is refused with one line naming it, before anything runs or
changes (library and command line)."""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import Model
from mixprec.cli import main
from mixprec.train import CorruptCheckpointError, UnsafeCheckpointError
from mixprec.train.callbacks import Callback, ModelCheckpoint
from mixprec.train.data import train_test_loaders
from mixprec.train.models import MLP

FAST = ["--quiet", "--threads", "1", "--model", "mlp", "--batch-size", "128", "--device", "cpu"]


class CreatesFile:
    """Unpickling this calls ``open(marker, "w")``: the file appears if loading runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class RunsCommand:
    """The classic: unpickling calls ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def folder_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def fresh_model() -> tuple[Model, object]:
    torch.manual_seed(0)
    train, _ = train_test_loaders(batch_size=256, seed=0, image=False)
    net = MLP(64, hidden=(16,), num_classes=10)
    return Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1)), train


def small_model(tmp_path: Path, epochs: int = 1) -> tuple[Model, object]:
    model, train = fresh_model()
    model.train(epochs, train, callbacks=[ModelCheckpoint(tmp_path)])
    return model, train


def resume_from(path: Path) -> None:
    """A fresh model resumed from ``path`` (the checkpoint is read before anything runs)."""
    model, train = fresh_model()
    model.train(2, train, resume=path)


PLAIN = (torch.Tensor, str, int, float, bool, type(None), torch.Size, torch.dtype, torch.device)


def plain_data(value) -> bool:
    """Whether ``value`` holds only tensors and plain data (containers of them)."""
    if isinstance(value, dict):
        return all(plain_data(k) and plain_data(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(plain_data(v) for v in value)
    return isinstance(value, PLAIN)


def poisoned_copy(honest: Path, target: Path, payload: object) -> None:
    """A real checkpoint whose callback state carries ``payload`` (what an attacker edits)."""
    data = torch.load(honest, weights_only=True)
    data["callbacks"]["History:0"]["steps"] = [payload]
    torch.save(data, target)


@pytest.mark.parametrize("kind", [CreatesFile, RunsCommand])
def test_the_library_refuses_a_malicious_checkpoint_and_changes_nothing(tmp_path, kind):
    model, train = small_model(tmp_path)
    marker = tmp_path / "pwned"
    evil = tmp_path / "epoch0002.pt"
    poisoned_copy(tmp_path / "epoch0001.pt", evil, kind(marker))
    weights = {k: v.clone() for k, v in model.network.state_dict().items()}
    steps = int(model.optimizer.iterations)
    with pytest.raises(UnsafeCheckpointError) as err:
        model.train(3, train, resume=evil)
    message = str(err.value)
    assert str(evil) in message and "refused" in message and "\n" not in message
    assert not marker.exists()
    assert int(model.optimizer.iterations) == steps
    for key, value in model.network.state_dict().items():
        assert torch.equal(value, weights[key]), key
    # The file is live: an unsafe load would have run the attacker's call.
    torch.load(evil, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_plain_pickle_of_an_object_is_refused_at_every_protocol(tmp_path, protocol):
    marker = tmp_path / "pwned"
    path = tmp_path / "epoch0001.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": CreatesFile(marker)}, f, protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match="would call .*open"):
        resume_from(path)
    assert not marker.exists()


def test_the_command_refuses_a_malicious_run_folder_in_one_line(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--epochs", "1", *FAST]) == 0
    marker = tmp_path / "pwned"
    evil = run / "checkpoints" / "epoch0002.pt"  # newer than the honest one: picked first
    poisoned_copy(run / "checkpoints" / "epoch0001.pt", evil, CreatesFile(marker))
    before = folder_digest(run)
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "train", "--resume", str(run), "--epochs", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("mixprec: error: ") and str(evil) in lines[0]
    assert "refused" in lines[0] and "run code" in lines[0]
    assert not marker.exists()
    assert folder_digest(run) == before  # nothing in the folder changed


def test_honest_checkpoints_hold_only_plain_data_and_resume_bit_exactly(tmp_path):
    full, _ = small_model(tmp_path / "full", epochs=2)
    small_model(tmp_path / "part", epochs=1)
    torch.manual_seed(0)
    train, _ = train_test_loaders(batch_size=256, seed=0, image=False)
    net = MLP(64, hidden=(16,), num_classes=10)
    resumed = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    resumed.train(2, train, resume=tmp_path / "part" / "epoch0001.pt")
    for a, b in zip(full.network.parameters(), resumed.network.parameters()):
        assert torch.equal(a, b)
    payload = torch.load(tmp_path / "full" / "epoch0002.pt", weights_only=True)
    assert plain_data(payload)
    assert payload["format"] == "mixprec-checkpoint-1" and payload["epoch"] == 2


class KeepsAnObject(Callback):
    def state_dict(self):
        return {"best": object()}


def test_saving_state_a_safe_load_could_not_read_is_refused(tmp_path):
    torch.manual_seed(0)
    train, _ = train_test_loaders(batch_size=256, seed=0, image=False)
    net = MLP(64, hidden=(16,), num_classes=10)
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"\['KeepsAnObject:0'\]\['best'\] is a object"):
        model.train(1, train, callbacks=[KeepsAnObject(), ModelCheckpoint(tmp_path)])
    assert list(tmp_path.iterdir()) == []  # not even a temporary file


class Threshold:
    def __init__(self, value: float) -> None:
        self.value = value


class KeepsAThreshold(Callback):
    def __init__(self) -> None:
        self.threshold = Threshold(0.5)

    def state_dict(self):
        return {"t": self.threshold}

    def load_state_dict(self, state_dict):
        self.threshold = state_dict["t"]


def test_a_type_registered_as_a_safe_global_is_accepted(tmp_path):
    model, train = fresh_model()
    with pytest.raises(TypeError, match="add_safe_globals"):
        model.train(1, train, callbacks=[KeepsAThreshold(), ModelCheckpoint(tmp_path)])
    assert list(tmp_path.iterdir()) == []
    with torch.serialization.safe_globals([Threshold]):
        model, train = fresh_model()
        model.train(1, train, callbacks=[KeepsAThreshold(), ModelCheckpoint(tmp_path)])
        resumed, train = fresh_model()
        kept = KeepsAThreshold()
        kept.threshold = None
        resumed.train(1, train, callbacks=[kept], resume=tmp_path / "epoch0001.pt")
    assert isinstance(kept.threshold, Threshold) and kept.threshold.value == 0.5


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],
        lambda data: b"",
        lambda data: random.Random(0).randbytes(4096),
        lambda data: b"not a checkpoint\n",
    ],
    ids=["truncated", "empty", "random", "text"],
)
def test_a_damaged_file_is_corrupt_not_unsafe_and_named(tmp_path, damage):
    small_model(tmp_path)
    path = tmp_path / "epoch0001.pt"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptCheckpointError, match="not a readable checkpoint") as err:
        resume_from(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def refused_and_nothing_changed(path: Path, match: str, callbacks=()) -> str:
    """Resume a fresh model from ``path``: a ``CheckpointError`` matching ``match``, one
    line naming the file, and the network, the optimizer, the global random state, the
    data loader's generator and the checkpoint folder as they were."""
    from mixprec.train import CheckpointError

    model, train = fresh_model()
    weights = {k: v.clone() for k, v in model.network.state_dict().items()}
    rng, loader = torch.get_rng_state(), train.generator.get_state()
    files = folder_digest(path.parent)
    with pytest.raises(CheckpointError, match=match) as err:
        model.train(2, train, callbacks=list(callbacks), resume=path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    assert all(torch.equal(v, model.network.state_dict()[k]) for k, v in weights.items())
    assert int(model.optimizer.iterations) == 0 and float(model.optimizer.loss_scale) == 1.0
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(train.generator.get_state(), loader)
    assert folder_digest(path.parent) == files
    return message


@pytest.mark.parametrize("entry", ["torch", "loader"])
@pytest.mark.parametrize("damage", ["short", "long", "float"])
def test_a_random_state_of_the_wrong_size_or_type_is_refused_and_changes_nothing(
    tmp_path, entry, damage
):
    small_model(tmp_path)
    path = tmp_path / "epoch0001.pt"
    payload = torch.load(path, weights_only=True)
    state = payload["rng"][entry]
    payload["rng"][entry] = {
        "short": state[:-8],
        "long": torch.cat([state, state[:16]]),
        "float": state.float(),
    }[damage]
    torch.save(payload, path)
    message = refused_and_nothing_changed(path, "random-number state")
    assert f"rng['{entry}']" in message


class Counts(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, state):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state_dict):
        self.steps = int(state_dict["steps"])


def test_state_of_a_callback_this_run_lacks_is_refused_and_changes_nothing(tmp_path):
    model, train = fresh_model()
    model.train(1, train, callbacks=[Counts(), Counts(), ModelCheckpoint(tmp_path)])
    path = tmp_path / "epoch0001.pt"
    message = refused_and_nothing_changed(path, "Counts:1", callbacks=[Counts()])
    assert "pass the same callbacks" in message
    refused_and_nothing_changed(path, "Counts:0, Counts:1")  # none of them
    resumed, train = fresh_model()
    first, second = Counts(), Counts()
    resumed.train(2, train, callbacks=[second, first], resume=path)  # any order
    assert first.steps == second.steps == 2 * len(train)
