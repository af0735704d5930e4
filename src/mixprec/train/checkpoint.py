"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint is one ``torch.save`` file holding a dict::

    format      CHECKPOINT_FORMAT, so another file is never mistaken for one
    amp_level   the level the network was prepared with (checked on load)
    dtype       the low-precision dtype, as text (checked on load)
    epoch, step the run's counters after the last completed epoch
    model       the network's state_dict
    optimizer   the LossScaleOptimizer's state_dict (loss-scale state, master weights...)
    callbacks   the CallbackList's state_dict (History, EarlyStopping, schedules...), or None
    rng         the global torch (and CUDA) random states and the data loader's generator

Files are written to a temporary name and then renamed, so a crash mid-save never
leaves a half-written checkpoint behind.

>>> import tempfile, torch
>>> from mixprec.train.callbacks import RunState
>>> from mixprec.optim import LossScaleOptimizer
>>> net = torch.nn.Linear(2, 2)
>>> opt = LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
>>> path = Path(tempfile.mkdtemp()) / "epoch0001.pt"
>>> save_checkpoint(path, network=net, optimizer=opt, state=RunState(epoch=1, step=5),
...                 amp_level="O1", dtype=torch.bfloat16)
>>> state = RunState()
>>> load_checkpoint(path, network=net, optimizer=opt, state=state, amp_level="O1",
...                 dtype=torch.bfloat16, device=torch.device("cpu"))
>>> state.epoch, state.step
(1, 5)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mixprec.train.callbacks import CallbackList, RunState

__all__ = ["CHECKPOINT_FORMAT", "save_checkpoint", "load_checkpoint", "loader_generator"]

#: The ``format`` entry of every checkpoint this module writes.
CHECKPOINT_FORMAT = "mixprec-checkpoint-1"


def loader_generator(dataset: Any) -> torch.Generator | None:
    """The generator that decides a ``DataLoader``'s shuffling (``None`` if it has none)."""
    return getattr(dataset, "generator", None)


def save_checkpoint(
    path: str | Path,
    *,
    network: torch.nn.Module,
    optimizer: Any,
    state: RunState,
    amp_level: str,
    dtype: torch.dtype,
    callbacks: CallbackList | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Write network, optimizer, counters, callback and random-number state to ``path``.

    ``generator`` is the training data loader's shuffling generator, if any.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "amp_level": amp_level,
        "dtype": str(dtype),
        "epoch": state.epoch,
        "step": state.step,
        "model": network.state_dict(),
        "optimizer": optimizer.state_dict(),
        "callbacks": None if callbacks is None else callbacks.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "loader": None if generator is None else generator.get_state(),
        },
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def load_checkpoint(
    path: str | Path,
    *,
    network: torch.nn.Module,
    optimizer: Any,
    state: RunState,
    amp_level: str,
    dtype: torch.dtype,
    device: torch.device,
    callbacks: CallbackList | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Restore what :func:`save_checkpoint` wrote into the given objects, in place.

    Raises ``FileNotFoundError`` when ``path`` is not a file, and ``ValueError`` when it
    is not a mixprec checkpoint or was saved with another ``amp_level`` or ``dtype``
    (the parameters would not match the prepared network).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resume={str(path)!r}: no checkpoint file there")
    payload = torch.load(path, map_location=device, weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"resume={str(path)!r} is not a mixprec checkpoint")
    if payload["amp_level"] != amp_level or payload["dtype"] != str(dtype):
        raise ValueError(
            f"resume={str(path)!r} was saved with amp_level={payload['amp_level']!r}, "
            f"dtype={payload['dtype']}; this Model uses amp_level={amp_level!r}, "
            f"dtype={dtype}: build the Model the same way to resume"
        )
    network.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if payload["callbacks"] is not None and callbacks is not None:
        callbacks.load_state_dict(payload["callbacks"])
    rng = payload["rng"]
    torch.set_rng_state(rng["torch"].cpu())
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if rng["loader"] is not None and generator is not None:
        generator.set_state(rng["loader"].cpu())
    state.epoch, state.step = payload["epoch"], payload["step"]
    state.skipped_steps = int(optimizer.skipped_steps)
