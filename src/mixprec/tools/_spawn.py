"""Run a function on several local processes joined by ``torch.distributed``, bounded in time.

What the distributed tests and the benchmarks need: ``world_size`` fresh processes
(``spawn``, so nothing of the parent's state leaks in) that rendezvous over TCP on
``127.0.0.1`` at a free port, each running ``fn(rank, *args)`` inside an initialised
default process group, and handing back what ``fn`` returned. A rank that raises
ends the run (the others are terminated) with its traceback; a run that takes longer
than ``timeout`` seconds is killed as a whole and reported as a ``TimeoutError``.
No process outlives :func:`run_on_ranks`.

Results travel through ``torch.save`` files, so they may hold tensors, numbers,
strings and containers of these (read back with ``weights_only=True``).

>>> 0 < free_port() < 2**16
True

:func:`run_on_ranks` shows a run on two ranks.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ADDRESS = "127.0.0.1"


def free_port() -> int:
    """A TCP port on ``127.0.0.1`` that was free a moment ago (the OS picks it).

    For a rendezvous of one's own, e.g. ``torchrun --master_port``:

    >>> 0 < free_port() < 2**16
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ADDRESS, 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    timeout: float,
    results: str,
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR=ADDRESS, MASTER_PORT=str(port), RANK=str(rank),
        LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
    )  # fmt: skip
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
    )
    try:
        result = fn(rank, *args)
        # What ``fn`` left in reference cycles (DDP's reducer and its pending gloo work)
        # goes now, while the group and the interpreter are alive: freed later, during
        # the interpreter's teardown, gloo's worker threads can abort the process.
        gc.collect()
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(results) / f"rank{rank}.pt")


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    threads: int = 1,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function) and its arguments
    picklable. Each process uses ``threads`` intra-op threads. Raises the first failing
    rank's error (as ``torch.multiprocessing.ProcessRaisedException``) or
    ``TimeoutError``; either way every process has been ended when it returns.

    Two ranks that all-reduce their rank numbers, as a script (``fn`` is imported by
    name in each process; a few seconds, as each one imports torch)::

        import torch
        from mixprec.tools import run_on_ranks

        def add_ranks(rank):
            t = torch.tensor([float(rank)])
            torch.distributed.all_reduce(t)
            return t

        if __name__ == "__main__":
            print(run_on_ranks(add_ranks, world_size=2))  # [tensor([1.]), tensor([1.])]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    with tempfile.TemporaryDirectory(prefix="mixprec-ranks-") as results:
        context = mp.start_processes(
            _rank_main,
            args=(fn, args, world_size, free_port(), backend, threads, timeout, results),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{world_size} ranks running {fn.__name__} did not finish within "
                        f"{timeout:g} s; they were stopped"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [
            torch.load(Path(results) / f"rank{r}.pt", weights_only=True) for r in range(world_size)
        ]
