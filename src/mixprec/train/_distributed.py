"""The main job on several processes: data parallelism under ``torchrun``.

Started by ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``), :func:`process_group_from_env` joins the
processes into one ``torch.distributed`` group (gloo on CPUs, NCCL for CUDA
tensors, each process on the GPU of its ``LOCAL_RANK``), and the run is data
parallel:

* :func:`shard_loader` gives each rank its share of every epoch through a
  ``DistributedSampler`` (:class:`ShardedEpochs`); ``--batch-size`` stays the global
  batch, split evenly across the ranks, and the ranks' batches of a step together
  are the batch one process would take at that step: N processes train what one
  process trains, up to rounding;
* :class:`DistributedModel` trains through ``DistributedDataParallel`` (gradients
  averaged over the ranks during backward); the ``LossScaleOptimizer`` all-reduces
  its overflow flag, so all ranks skip together and keep one loss scale; the loss
  it reports and the training metrics are the whole batch's, over all ranks;
* rank 0 alone prints and writes (:func:`for_this_rank`, :func:`run_on_main`);
  every rank reads a checkpoint to resume. Dropout draws from a seed per epoch and
  rank, so a resumed run continues exactly.

In one process (no ``torchrun``) all of this stands aside:

>>> from torch.utils.data import TensorDataset
>>> loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)
>>> is_distributed(), is_main_process(), shard_loader(loader, seed=0) is loader
(False, True, True)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from mixprec.train._loop import Model
from mixprec.train.callbacks import Callback, CSVLogger, ModelCheckpoint, ProgressBar
from mixprec.train.metrics import Metric

#: Callbacks that print or write files: rank 0's alone.
WRITERS = (ProgressBar, CSVLogger, ModelCheckpoint)


def is_distributed() -> bool:
    """Whether this process is one of several in an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main_process() -> bool:
    """Rank 0, or the only process."""
    return not is_distributed() or dist.get_rank() == 0


def process_group_from_env(run: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``run`` inside a process group when ``torchrun`` started several processes.

    The group is created from the environment ``torchrun`` sets and destroyed when
    ``run`` returns or raises (a group that already exists is used as it is). Ranks
    other than 0 print nothing to stdout meanwhile. In one process ``run`` is called
    as it is.
    """

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available()
        create = launched and not dist.is_initialized()
        if create:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        try:
            if is_main_process():
                return run(*args, **kwargs)
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                return run(*args, **kwargs)
        finally:
            if create:
                dist.destroy_process_group()

    return wrapper


def run_on_main(fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(*args)`` on rank 0 only; if it raises, every rank raises its error.

    For steps that write (creating the output folder): the other ranks must not go
    on to train, and wait on rank 0 in a collective, when rank 0 has stopped.
    """
    if not is_distributed():
        fn(*args)
        return
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - handed to every rank, then raised
            outcome[0] = err
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]


class ShardedEpochs(DistributedSampler):
    """A ``DistributedSampler`` whose epochs are the ones a single process would draw.

    Each epoch's order is drawn exactly as the one-process loader draws it (a
    ``RandomSampler`` on the same generator), padded as ``DistributedSampler`` pads,
    and rank ``r`` takes every ``world``-th sample from position ``r``: so with the
    per-rank batch ``B / world``, step ``k``'s batches of all ranks together are step
    ``k``'s batch of one process, and N processes train what one process trains. The
    generator is the loader's, which checkpoints save and restore (exact resume).
    """

    def __init__(self, dataset: Any, generator: torch.Generator, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True)
        self.order = RandomSampler(dataset, generator=generator)

    def __iter__(self):
        indices = list(self.order)
        repeats = -(-self.total_size // len(indices))
        indices = (indices * repeats)[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])


def shard_loader(loader: DataLoader, seed: int) -> DataLoader:
    """``loader`` with each rank drawing its share of every epoch (:class:`ShardedEpochs`).

    ``loader.batch_size`` is the global batch: each rank takes ``batch_size / world``
    samples per step. Raises ``ValueError`` when it does not divide evenly. Returns
    ``loader`` itself in one process.
    """
    if not is_distributed():
        return loader
    world = dist.get_world_size()
    if loader.batch_size % world:
        raise ValueError(
            f"--batch-size {loader.batch_size} (the global batch) does not split evenly over "
            f"{world} processes; pass a multiple of {world}"
        )
    generator = loader.generator or torch.Generator().manual_seed(seed)
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size // world,
        sampler=ShardedEpochs(loader.dataset, generator, world, dist.get_rank()),
        generator=generator,  # drawn from as one process's loader draws from it
        drop_last=loader.drop_last,
        pin_memory=loader.pin_memory,
    )


class EpochSeeds(Callback):
    """Each epoch, a random seed for that epoch and rank: dropout differs per rank, and a
    resumed run draws what it would have drawn."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_epoch_begin(self, state: Any) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(((self.seed * 100_003 + state.epoch) * world + rank) % 2**63)


def for_this_rank(callbacks: Sequence[Callback], seed: int) -> list:
    """The callbacks this rank runs: all of them on rank 0, none that print or write on
    the others; plus the per-epoch seeding of a data-parallel run."""
    if not is_distributed():
        return list(callbacks)
    kept = [c for c in callbacks if is_main_process() or not isinstance(c, WRITERS)]
    return [EpochSeeds(seed), *kept]


class RankSummed(Metric):
    """A metric over the samples of all ranks: its totals are summed across ranks when
    it is computed (a collective: every rank computes it at the same point)."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric
        super().__init__(metric.name)

    def reset(self) -> None:
        self.metric.reset()

    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss: Any = None) -> None:
        self.metric.update(logits, targets, loss=loss)

    def compute(self) -> float:
        total = copy.deepcopy(self.metric)
        for key in sorted(total._totals):
            dist.all_reduce(total._totals[key])
        device = next(iter(total._totals.values()), torch.zeros(())).device
        counts = torch.tensor(
            [float(total.count), float(getattr(total, "_host_sum", 0.0))], device=device
        )
        dist.all_reduce(counts)
        total.count = int(counts[0])
        if hasattr(total, "_host_sum"):
            total._host_sum = float(counts[1])
        return total.compute()


class DistributedModel(Model):
    """A :class:`~mixprec.train.Model` whose steps run data parallel over the process group.

    ``self.network`` stays the plain module (checkpoints, ``eval`` and ``predict`` use
    it unchanged, and a checkpoint of a distributed run resumes in one process and
    back); training goes through ``self.parallel``, its ``DistributedDataParallel``,
    built once the amp level has prepared the network. Every rank evaluates the whole
    evaluation set (the results agree: the parameters do).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not is_distributed():
            raise RuntimeError(
                "DistributedModel needs an initialised process group of 2 or more ranks; "
                "start the job with torchrun, or use Model"
            )
        super().__init__(*args, **kwargs)
        self.metrics = {
            name: RankSummed(m) if isinstance(m, Metric) else m for name, m in self.metrics.items()
        }

    def _prepare(self, dataset: Any) -> None:
        super()._prepare(dataset)
        if self._ready and self.__dict__.get("parallel") is None:
            self.parallel = torch.nn.parallel.DistributedDataParallel(self.network)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`Model.train_step`, through DDP; the loss returned is the mean over
        all ranks' batches (so every rank reports, and guards on, the same number)."""
        opt = self.optimizer
        out = self.parallel(x)
        loss = self.loss_fn(out.float(), y)
        self.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean / dist.get_world_size(), out.detach()

    @torch.no_grad()
    def eval(self, dataset: Any) -> dict[str, float]:
        summed = self.metrics
        self.metrics = {k: m.metric if isinstance(m, RankSummed) else m for k, m in summed.items()}
        try:
            return super().eval(dataset)
        finally:
            self.metrics = summed
