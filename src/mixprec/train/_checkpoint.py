"""Training checkpoints: everything needed to continue a run exactly where it stopped,
and nothing that can run code when it is loaded.

A checkpoint is one ``torch.save`` file holding a dict::

    format      CHECKPOINT_FORMAT, so another file is never mistaken for one
    amp_level   the level the network was prepared with (checked on load)
    dtype       the low-precision dtype, as text (checked on load)
    epoch, step the run's counters after the last completed epoch
    model       the network's state_dict
    optimizer   the LossScaleOptimizer's state_dict (loss-scale state, master weights...)
    callbacks   the CallbackList's state_dict (History, EarlyStopping, schedules...), or None
    rng         the global torch (and CUDA) random states and the data loader's generator

Everything in it is a tensor or plain data (dict, list, tuple, str, int, float, bool,
None): :func:`save_checkpoint` checks that before it writes, and :func:`read_checkpoint`
loads with ``torch.load(weights_only=True)``, which unpickles nothing else. A file that
would need any other object (a pickled class, a function call) is refused with
:class:`UnsafeCheckpointError` naming the file, before anything runs or changes. A
truncated or garbled file is a :class:`CorruptCheckpointError`, so a caller can fall
back to an older checkpoint (:func:`newest_readable`).

Files are written to a temporary name of this process, flushed to disk and then
renamed (:func:`mixprec.train._atomic.atomic_write`), so a crash mid-save never leaves a
half-written checkpoint under the real name, and a link there is replaced, never followed.
A write that fails (no space left on device) raises its ``OSError`` naming the file.

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
>>> _ = path.write_bytes(b"garbage")
>>> read_checkpoint(path, torch.device("cpu"))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mixprec.train._checkpoint.CorruptCheckpointError: .../epoch0001.pt: not a readable checkpoint ...
"""

from __future__ import annotations

import pickle
import pickletools
import re
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from mixprec.train._atomic import atomic_write
from mixprec.train.callbacks import CallbackList, RunState

#: The ``format`` entry of every checkpoint this module writes.
CHECKPOINT_FORMAT = "mixprec-checkpoint-1"

_PLAIN = (str, int, float, bool, complex, bytes, bytearray, type(None))
_TORCH_VALUES = (torch.Tensor, torch.Size, torch.dtype, torch.device)


class CheckpointError(ValueError):
    """A file that cannot be resumed from; the message names it and says why.

    Raised by ``Model.train(resume=...)`` (and ``mixprec train --resume``, exit 2) before
    anything is changed: for a file that could run code (:class:`UnsafeCheckpointError`),
    a damaged one (:class:`CorruptCheckpointError`), one in a format this version does not
    read, one whose weights, optimizer state or random-number states do not fit the model
    and this machine, or one holding the state of a callback the resuming run lacks.

    >>> import tempfile, torch
    >>> from mixprec.train import Model
    >>> path = Path(tempfile.mkdtemp()) / "epoch0001.pt"
    >>> _ = path.write_bytes(b"not a checkpoint")
    >>> net = torch.nn.Linear(4, 2)
    >>> model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    >>> try:
    ...     model.train(1, [(torch.randn(8, 4), torch.randint(0, 2, (8,)))], resume=path)
    ... except CheckpointError as err:
    ...     print(type(err).__name__, "not a readable checkpoint" in str(err))
    CorruptCheckpointError True
    """


class UnsafeCheckpointError(CheckpointError):
    """The file holds pickled objects other than tensors and plain data: loading it could
    run code, so it is refused (nothing was executed)."""


class CorruptCheckpointError(CheckpointError):
    """The file is truncated, garbled, empty, or not a mixprec checkpoint."""


for _cls in (CheckpointError, UnsafeCheckpointError, CorruptCheckpointError):
    _cls.__module__ = __name__


def loader_generator(dataset: Any) -> torch.Generator | None:
    """The generator that decides a ``DataLoader``'s shuffling (``None`` if it has none)."""
    return getattr(dataset, "generator", None)


def check_plain_data(value: Any, where: str = "checkpoint") -> None:
    """Raise ``TypeError`` naming the first entry that ``torch.load(weights_only=True)``
    could not read back: anything but tensors, plain data and registered safe globals.

    >>> check_plain_data({"w": torch.ones(2), "steps": [1, 2], "name": "fc"})
    >>> check_plain_data({"cb": {"best": object()}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: checkpoint['cb']['best'] is a object: a checkpoint holds only tensors ...
    """
    if isinstance(value, _PLAIN + _TORCH_VALUES):
        return
    if isinstance(value, (dict, OrderedDict)):
        for key, item in value.items():
            check_plain_data(key, f"{where} key {key!r}")
            check_plain_data(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple, set)):
        for i, item in enumerate(value):
            check_plain_data(item, f"{where}[{i}]")
        return
    registered = tuple(g for g in torch.serialization.get_safe_globals() if isinstance(g, type))
    if registered and isinstance(value, registered):
        return
    raise TypeError(
        f"{where} is a {type(value).__qualname__}: a checkpoint holds only tensors and plain "
        "data (dict, list, tuple, str, int, float, bool, None) so that loading it can never "
        "run code; convert it (e.g. float(x), x.tolist()) or register the type with "
        "torch.serialization.add_safe_globals"
    )


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

    ``generator`` is the training data loader's shuffling generator, if any. Raises
    ``TypeError`` (and writes nothing) if a callback's state holds something other
    than tensors and plain data, which a safe load could not read back.
    """
    path = Path(path)
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
    check_plain_data(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: _save_to(payload, f))


class _Recording:
    """A file for ``torch.save`` that remembers the ``OSError`` of a failed write: torch
    reports it as ``RuntimeError: [enforce fail ...] unexpected pos``, naming nothing."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except BaseException as err:  # OSError, or Ctrl-C arriving mid-write
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()


def _save_to(payload: dict[str, Any], file: Any) -> None:
    recording = _Recording(file)
    try:
        torch.save(payload, recording)
    except BaseException:
        if recording.error is not None:  # no space left, an I/O error, Ctrl-C: say that
            raise recording.error from None
        raise


def _pickled_globals(path: Path) -> list[str] | None:
    """The ``module.name`` globals a pickle file (or a torch zip's ``data.pkl``) refers
    to, read with :mod:`pickletools` (which parses, never executes); ``None`` when the
    bytes are not a complete pickle stream."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                data = archive.read(name)
        else:
            data = path.read_bytes()
        found, recent, memo = [], [], {}
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                found.append(".".join(str(v) for v in recent[-2:]))
            elif op.name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
                memo[len(memo) if arg is None else arg] = recent[-1] if recent else None
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                recent.append(memo.get(arg))
            elif isinstance(arg, str):
                recent.append(arg)
        return found
    except Exception:  # noqa: BLE001 - any parse failure means "not a pickle stream"
        return None


def _refusal(path: Path, err: Exception) -> CheckpointError:
    """The one-line error for a file ``torch.load(weights_only=True)`` could not read."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError):
        blocked = re.search(r"GLOBAL ([\w.]+)", text)
        names = [blocked.group(1)] if blocked else _pickled_globals(path)
        foreign = [n for n in names or () if not n.startswith(("torch.", "collections."))]
        if foreign or names:
            return UnsafeCheckpointError(
                f"{path}: refused: loading it would call {(foreign or names)[0]}, which can "
                "run code; mixprec checkpoints hold only tensors and plain data, so this file "
                "was not written by mixprec or was altered (nothing was run)"
            )
    # torch's weights-only messages open with a paragraph of advice; the cause follows.
    text = text.split("WeightsUnpickler error:", 1)[-1]
    detail = next((line.strip() for line in text.splitlines() if line.strip()), "")
    detail = detail.split(". ", 1)[0]
    if isinstance(err, EOFError) or not detail:
        detail = "the file is empty or ends too early"
    return CorruptCheckpointError(
        f"{path}: not a readable checkpoint (truncated or corrupted: "
        f"{type(err).__name__}: {detail[:120]})"
    )


def read_checkpoint(path: str | Path, device: torch.device) -> dict[str, Any]:
    """Load ``path`` safely and check it is a mixprec checkpoint; change nothing else.

    Raises ``FileNotFoundError`` when ``path`` is not a file,
    :class:`UnsafeCheckpointError` when it would need arbitrary unpickling,
    :class:`CorruptCheckpointError` when it is unreadable or not a mixprec checkpoint,
    and :class:`CheckpointError` when it is one in a format this version does not read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resume={str(path)!r}: no checkpoint file there")
    try:
        with warnings.catch_warnings():
            # The error below says what is wrong with a foreign pickle; no second voice.
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 - weights-only: garbage fails in many ways, runs nothing
        raise _refusal(path, err) from None
    found = payload.get("format") if isinstance(payload, dict) else None
    if not isinstance(found, str) or not found.startswith("mixprec-checkpoint-"):
        raise CorruptCheckpointError(
            f"{path}: not a readable checkpoint (not a mixprec checkpoint)"
        )
    if found != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} is in format {found!r}; this version of mixprec reads {CHECKPOINT_FORMAT!r}: "
            "load it with the mixprec version that wrote it (see the README, 'Checkpoints')"
        )
    _check_entries(path, payload)
    return payload


#: The entries of a checkpoint and what each must be.
_ENTRIES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "amp_level": (str, "a level name"),
    "dtype": (str, "a dtype name"),
    "epoch": (int, "a whole number >= 0"),
    "step": (int, "a whole number >= 0"),
    "model": (dict, "a state_dict"),
    "optimizer": (dict, "a state_dict"),
    "callbacks": ((dict, type(None)), "a state_dict or None"),
    "rng": (dict, "random states"),
}


def _check_entries(path: Path, payload: dict[str, Any]) -> None:
    """A :class:`CorruptCheckpointError` for a missing or malformed entry (a file edited
    by hand, or damaged inside a valid archive): nothing is loaded from it."""
    for key, (kind, what) in _ENTRIES.items():
        if key not in payload:
            raise CorruptCheckpointError(
                f"{path}: not a readable checkpoint (it has no {key!r} entry)"
            )
        value = payload[key]
        bad = not isinstance(value, kind) or isinstance(value, bool)
        if key in ("epoch", "step") and not bad:
            bad = value < 0
        if bad:
            raise CorruptCheckpointError(
                f"{path}: not a readable checkpoint ({key} is {str(value)[:40]!r}, expected {what})"
            )
    rng = payload["rng"]
    if not isinstance(rng.get("torch"), torch.Tensor) or "cuda" not in rng or "loader" not in rng:
        raise CorruptCheckpointError(f"{path}: not a readable checkpoint (damaged 'rng' entry)")
    problem = _generator_refuses(rng["torch"], torch.device("cpu"))
    if problem:
        raise CorruptCheckpointError(
            f"{path}: not a readable checkpoint (damaged 'rng' entry: rng['torch'] is not "
            f"a random-number state torch can restore: {problem})"
        )


def _generator_refuses(state: Any, device: torch.device) -> str | None:
    """Why a generator on ``device`` would refuse ``state`` (``None`` if it takes it).

    Tried on a new generator, never on a live one: the check changes no random stream.
    torch itself checks the type, the size and the content of a state; its error is one
    line."""
    if not isinstance(state, torch.Tensor):
        return f"a {type(state).__name__}, not a tensor"
    try:
        torch.Generator(device=device).set_state(state.cpu())
    except (RuntimeError, TypeError) as err:
        return " ".join(str(err).split())[:160]
    return None


def _check_rng_fits(path: Path, rng: dict[str, Any], generator: torch.Generator | None) -> None:
    """A :class:`CheckpointError` when a saved random-number state does not fit this
    machine's generators (another size: another generator or device, or a damaged
    file). Checked before anything is loaded; ``rng['torch']`` was checked on read."""
    states = []
    if rng["loader"] is not None and generator is not None:
        states.append(("rng['loader']", rng["loader"], generator.device))
    if rng["cuda"] is not None and torch.cuda.is_available():
        cuda = rng["cuda"]
        if not isinstance(cuda, list | tuple) or len(cuda) != torch.cuda.device_count():
            count = len(cuda) if isinstance(cuda, list | tuple) else type(cuda).__name__
            raise CheckpointError(
                f"{path}: its rng['cuda'] holds {count} random-number state(s) for the "
                f"{torch.cuda.device_count()} CUDA device(s) here; resume on a machine with "
                "as many devices as the run that wrote it"
            )
        states += [(f"rng['cuda'][{i}]", s, torch.device("cuda", i)) for i, s in enumerate(cuda)]
    for name, state, device in states:
        problem = _generator_refuses(state, device)
        if problem:
            raise CheckpointError(
                f"{path}: its {name} is not a random-number state this {device.type} "
                f"generator can restore ({problem}); the file is damaged or was written "
                "for another generator"
            )


def _check_fits(path: Path, network: torch.nn.Module, saved: dict[str, Any]) -> None:
    """A :class:`CheckpointError` when the saved weights do not fit ``network``: another
    model, or data with another number of features or classes. Checked before anything
    is loaded, so the network is left as it was."""
    own = network.state_dict()
    missing = [k for k in own if k not in saved]
    extra = [k for k in saved if k not in own]
    for key, tensor in own.items():
        value = saved.get(key)
        if isinstance(value, torch.Tensor) and value.shape != tensor.shape:
            raise CheckpointError(
                f"{path} does not fit this model: {key} has shape {list(value.shape)} in the "
                f"checkpoint and {list(tensor.shape)} here (another model, or data with "
                "another number of features or classes)"
            )
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which this model has not"
        raise CheckpointError(
            f"{path} does not fit this model: the checkpoint {what} (another model?)"
        )


def _check_optimizer_fits(path: Path, optimizer: Any, saved: dict[str, Any]) -> None:
    """A :class:`CheckpointError` when the saved optimizer state is another optimizer's:
    its parameter groups hold settings this optimizer has not (Adam's ``betas`` for an
    SGD). torch's load would take them in place of this optimizer's own and fail only at
    the next step. Settings a newer torch added are not asked for: torch fills them in."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return  # the optimizer's own load names this mismatch
    for i, (theirs, ours) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(theirs, dict):
            return
        extra = sorted(set(theirs) - set(ours) - {"params", "param_names"})
        if extra:
            raise CheckpointError(
                f"{path} does not fit this model's optimizer: the checkpoint's parameter "
                f"group {i} has settings {', '.join(map(repr, extra))}, which this "
                f"{type(getattr(optimizer, 'inner_optimizer', optimizer)).__name__} has not "
                "(another optimizer?)"
            )


def newest_readable(
    paths: Iterable[Path],
    device: torch.device,
    on_skip: Callable[[Path, CheckpointError], None] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The first of ``paths`` (newest first) that reads, with its payload; ``None`` if none.

    A corrupt file is passed to ``on_skip`` and the next one is tried; an unsafe one,
    or one in an unknown format, stops the search with its error: someone put it there.
    """
    for path in paths:
        try:
            return path, read_checkpoint(path, device)
        except UnsafeCheckpointError:
            raise
        except CorruptCheckpointError as err:
            if on_skip is not None:
                on_skip(path, err)
    return None


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

    Raises what :func:`read_checkpoint` raises, ``ValueError`` when the file was saved
    with another ``amp_level`` or ``dtype`` (the parameters would not match the prepared
    network), and :class:`CheckpointError` when its weights, optimizer state or random
    states do not fit, or when it holds the state of a callback that ``callbacks`` lacks
    (that progress would be dropped without a word); in every such case nothing has been
    changed: all of it is checked before anything is loaded.
    """
    payload = read_checkpoint(path, device)
    if payload["amp_level"] != amp_level or payload["dtype"] != str(dtype):
        raise ValueError(
            f"resume={str(path)!r} was saved with amp_level={payload['amp_level']!r}, "
            f"dtype={payload['dtype']}; this Model uses amp_level={amp_level!r}, "
            f"dtype={dtype}: build the Model the same way to resume"
        )
    path = Path(path)
    _check_fits(path, network, payload["model"])
    _check_optimizer_fits(path, optimizer, payload["optimizer"])
    _check_rng_fits(path, payload["rng"], generator)
    if payload["callbacks"] is not None and callbacks is not None:
        try:
            callbacks.check_state_dict(payload["callbacks"])
        except ValueError as err:
            raise CheckpointError(f"{path}: {err}") from None
    # The optimizer first: its load checks everything before it changes anything, and
    # the network's cannot fail after _check_fits. The other way round, a refused
    # optimizer state would leave the checkpoint's weights in a network whose optimizer
    # state (float32 masters, moments) belongs to other ones.
    try:
        optimizer.load_state_dict(payload["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as err:
        detail = " ".join(str(err).split())[:120]
        raise CheckpointError(
            f"{path} does not fit this model's optimizer ({type(err).__name__}: {detail})"
        ) from None
    network.load_state_dict(payload["model"])
    if payload["callbacks"] is not None and callbacks is not None:
        callbacks.load_state_dict(payload["callbacks"])
    rng = payload["rng"]
    torch.set_rng_state(rng["torch"].cpu())
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])  # map_location moved them
    if rng["loader"] is not None and generator is not None:
        generator.set_state(rng["loader"].cpu())
    state.epoch, state.step = payload["epoch"], payload["step"]
    state.skipped_steps = int(optimizer.skipped_steps)
