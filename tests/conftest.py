"""Shared test fixtures."""

from __future__ import annotations

import gc

import pytest
import torch


def pytest_sessionstart(session: pytest.Session) -> None:
    """A collection runs every 10,000 allocations instead of 700 (see
    :func:`_collect_only_this_modules_objects`); memory is still freed by reference
    counts at once, only cycles wait longer."""
    gc.set_threshold(10_000, 10, 10)
    # The tests' tensors are small: a second thread saves little on a quiet machine, and
    # when anything else runs on the cores, OpenMP's hand-offs make a 10 s training test
    # take minutes (measured on 2 cores: 117 s with torch's 2 threads, 10 s with one).
    # Subprocesses the tests start pass ``OMP_NUM_THREADS=1`` or ``--threads 1`` themselves.
    torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _collect_only_this_modules_objects():
    """Garbage collection cost a fifth of the suite's time (62 of about 300 s): the heap
    grows past a million objects (the imports, compiled graphs, models), and a full
    collection walks all of it, a few hundred times (``live_tensor_bytes`` collects
    before it counts). What outlives the modules before is frozen (kept out of every
    collection; still freed by reference counts) at the start of each module. Frozen
    objects are invisible to ``gc.get_objects()``, so the memory tests, which count
    what they allocate themselves, see exactly that."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: threads only add contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """The CLI runs in-process in some tests, and ``--threads N`` sets the process's
    torch threads: restore them, so that later tests' numerics do not depend on order."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class MachineWentAway(Exception):
    """Raised by :func:`dies_after_epoch`'s checkpoint callback."""


@pytest.fixture
def dies_after_epoch(monkeypatch):
    """``dies_after_epoch(n)``: ``mixprec train`` in this test raises :class:`MachineWentAway`
    right after writing epoch ``n``'s checkpoint (as if the machine went away); returns
    the exception type. ``monkeypatch.undo()`` gives the real callback back."""
    from mixprec.train.callbacks import ModelCheckpoint

    def arm(epoch: int) -> type[Exception]:
        save = ModelCheckpoint.on_epoch_end

        def on_epoch_end(self, state):
            save(self, state)
            if state.epoch == epoch:
                raise MachineWentAway

        monkeypatch.setattr(ModelCheckpoint, "on_epoch_end", on_epoch_end)
        return MachineWentAway

    return arm


@pytest.fixture
def full_and_interrupted(tmp_path, monkeypatch, capsys, dies_after_epoch):
    """``full_and_interrupted(argv)``: ``mixprec train argv`` run to its end in ``full/``
    and, in ``part/``, stopped right after epoch 2's checkpoint (the real callback is
    given back after); returns ``(full, part, what the full run printed)``."""
    from mixprec.cli import main

    def run(argv: list[str]):
        full, part = tmp_path / "full", tmp_path / "part"
        assert main(["train", "--out", str(full), *argv]) == 0
        printed = capsys.readouterr().out
        with pytest.raises(dies_after_epoch(2)):
            main(["train", "--out", str(part), *argv])
        monkeypatch.undo()
        capsys.readouterr()
        return full, part, printed

    return run


#: The lock file of a run folder: a running ``mixprec train`` holds an ``flock`` on it.
RUN_LOCK = ".mixprec.lock"


@pytest.fixture
def hold_run_folder():
    """``with hold_run_folder(folder):`` holds ``folder`` as a running ``mixprec`` process
    does (an exclusive ``flock`` on its ``.mixprec.lock``, holding the holder's pid, which
    a refused process names); the lock and its file go when the block ends."""
    import contextlib
    import fcntl
    import os

    @contextlib.contextmanager
    def hold(folder):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / RUN_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            yield
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)

    return hold
