"""The main job on several processes: ``mixprec train`` data parallel over 2 ranks
(gloo, 127.0.0.1) writes one set of outputs from rank 0, prints from rank 0 alone,
resumes exactly, and (slow, through the real ``torchrun`` command) reaches the
accuracy of one process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo import needs_gloo

from mixprec.cli import main
from mixprec.tools import free_port, run_on_ranks
from mixprec.train._distributed import (
    DistributedModel,
    for_this_rank,
    is_main_process,
    shard_loader,
)
from mixprec.train.data import train_val_test_loaders

pytestmark = needs_gloo

FAST = ["--model", "mlp", "--quiet", "--threads", "1"]
#: What a run folder holds (docs/guides/cli.md): these files and ``checkpoints/``.
RUN_FILES = ("config.json", "metrics.json", "metrics.csv", "loss.png", "accuracy.png",
             "loss_scale.png")  # fmt: skip


def train(argv: list[str]) -> dict:
    """``mixprec train ...`` in this process: its exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", *argv])
    return {"code": code, "stdout": out.getvalue()}


def epochs_of_batches(loader, epochs: int = 2) -> list[torch.Tensor]:
    return [x for _ in range(epochs) for x, _ in loader]


def main_job(rank: int, folder: str) -> dict:
    run = f"{folder}/run"
    one = train_val_test_loaders(batch_size=32, seed=0)[0]  # what the CLI trains on
    results = {
        "one": epochs_of_batches(one),
        "mine": epochs_of_batches(shard_loader(train_val_test_loaders(batch_size=32, seed=0)[0], 0)),
        "run": train([*FAST, "--epochs", "2", "--out", run]),
    }
    if rank == 0:  # the machine went away before epoch 2's checkpoint: keep it aside
        os.replace(f"{run}/checkpoints/epoch0002.pt", f"{folder}/epoch0002.pt")
        os.replace(f"{run}/metrics.json", f"{folder}/metrics.json")
    dist.barrier()
    results["resumed"] = train([*FAST, "--resume", run])
    results["odd_batch"] = train(
        [*FAST, "--epochs", "1", "--batch-size", "33", "--out", f"{folder}/x"]
    )
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    return folder, run_on_ranks(main_job, str(folder), world_size=2, timeout=240)


def metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def test_rank_0_alone_prints_and_writes_one_set_of_outputs(job):
    folder, ranks = job
    assert [r["run"]["code"] for r in ranks] == [0, 0]
    assert ranks[0]["run"]["stdout"].count("test accuracy:") == 1
    assert ranks[1]["run"]["stdout"] == ""
    run = folder / "run"
    assert sorted(p.name for p in run.iterdir()) == sorted([*RUN_FILES, "checkpoints"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "epoch0001.pt",
        "epoch0002.pt",
    ]
    # The global batch is split over the ranks: as many steps as one process takes.
    assert metrics(run)["steps"] == 2 * 41  # 1293 training digits (145 more validate) / 32 per step, 2 epochs


def test_the_ranks_batches_of_a_step_are_one_processs_batch(job):
    """N processes train what one process trains: same samples per step, every epoch."""
    _, ranks = job
    one = ranks[0]["one"]
    assert len(one) == len(ranks[0]["mine"]) == len(ranks[1]["mine"]) == 2 * 41
    for step, batch in enumerate(one):
        for rank, result in enumerate(ranks):
            share = batch[rank::2]
            # An epoch's last, short batch: DistributedSampler pads the epoch to an even
            # count (1293 samples), so a rank's share may carry one repeated sample more.
            assert torch.equal(result["mine"][step][: len(share)], share)
            assert len(result["mine"][step]) - len(share) in ((0,) if len(batch) == 32 else (0, 1))


def test_a_data_parallel_run_resumes_exactly(job):
    """Resumed from epoch 1's checkpoint, epoch 2 is the one the first run trained."""
    folder, ranks = job
    assert [r["resumed"]["code"] for r in ranks] == [0, 0]
    assert "resuming" in ranks[0]["resumed"]["stdout"] and ranks[1]["resumed"]["stdout"] == ""
    first, resumed = metrics(folder), metrics(folder / "run")
    assert resumed["history"]["loss"] == first["history"]["loss"]  # every step, bit for bit
    assert resumed["test_accuracy"] == first["test_accuracy"]
    a = torch.load(folder / "epoch0002.pt", weights_only=True)["model"]
    b = torch.load(folder / "run" / "checkpoints" / "epoch0002.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_global_batch_that_does_not_split_evenly_is_refused(job):
    folder, ranks = job
    assert [r["odd_batch"]["code"] for r in ranks] == [2, 2]
    assert not (folder / "x" / "config.json").exists()


def test_in_one_process_the_helpers_stand_aside():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=3)
    assert shard_loader(loader, seed=0) is loader
    assert for_this_rank([], seed=0) == []
    assert is_main_process()
    with pytest.raises(RuntimeError, match="start the job with torchrun"):
        DistributedModel(torch.nn.Linear(2, 2))


# -- the real command ------------------------------------------------------------------------


def torchrun(args: list[str], processes: int, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command += ["-m", "mixprec", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_torchrun_reaches_the_accuracy_of_one_process(tmp_path):
    """``torchrun --nproc_per_node 2 -m mixprec train`` (LeNet-5, level O2, 15 epochs):
    within 1 point of one process (mean of two seeds: bfloat16 rounding makes single
    runs drift apart by a few test samples), one set of outputs, each line printed once."""
    accuracy = {"one": [], "two": []}
    for seed in ("0", "1"):
        two = torchrun(["--quiet", "--seed", seed, "--out", f"two{seed}"], 2, tmp_path)
        assert two.returncode == 0, two.stderr
        assert two.stdout.count("test accuracy:") == 1 and two.stdout.count("mixprec train:") == 1
        one = subprocess.run(
            [sys.executable, "-m", "mixprec", "train", "--quiet", "--seed", seed, "--threads", "1"]
            + ["--out", f"one{seed}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert one.returncode == 0, one.stderr
        for n in accuracy:
            accuracy[n].append(metrics(tmp_path / f"{n}{seed}")["test_accuracy"])
    mean = {n: sum(v) / len(v) for n, v in accuracy.items()}
    assert abs(mean["two"] - mean["one"]) <= 0.01, accuracy
    assert sorted(p.name for p in (tmp_path / "two0").iterdir()) == sorted(
        [*RUN_FILES, "checkpoints"]
    )
    resumed = torchrun(["--resume", "two0", "--epochs", "16", "--quiet"], 2, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert metrics(tmp_path / "two0")["epochs"] == 16
