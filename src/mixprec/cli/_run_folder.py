"""Run folders: what ``mixprec train`` keeps in ``--out``, and the rules that keep two
runs from ever mixing in one folder.

A run folder holds :data:`RUN_FILES` and ``checkpoints/epochNNNN.pt``. ``config.json``
records the run's settings (data path absolute, level and dtype as resolved), so
``--resume DIR`` rebuilds exactly the run that wrote it, from any working directory.

* A new run refuses an ``--out`` that already holds a run, unless ``--overwrite``
  (then the old run's files are deleted first, and only the new run's remain); an
  ``--out`` that cannot be created or written is refused before anything is written.
* A run folder is owned: its files and ``checkpoints/`` are never links (a new run
  counts a link there, dangling or not, as a run file; ``--overwrite`` deletes the link
  itself, never what it points to; ``--resume`` refuses a folder holding one), and one
  process at a time holds it (:class:`RunLock`, an ``flock`` on ``.mixprec.lock``,
  released when the process exits or dies): a second ``train``, ``--resume`` or
  ``--overwrite`` on it is refused, naming the holder's pid.
* ``--resume DIR`` continues in ``DIR``: options given with it must agree with the
  run's settings (``--epochs N`` may extend it; ``--device``, ``--threads`` and
  ``--quiet`` are free); it loads the newest checkpoint that reads, skipping corrupt
  ones with one warning line, refusing an unsafe one; nothing is written before that
  checkpoint has been loaded.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> run_files(folder)
[]
>>> _ = (folder / "config.json").write_text("{}")
>>> check_new_out(folder, overwrite=False)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mixprec.cli._args.UsageError: --out ... already holds a run (config.json): ...
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from mixprec._checks import as_dtype
from mixprec.cli._args import FP8_RECIPES, LR_MAX, MASTER_WEIGHTS, OPTIMIZERS, UsageError
from mixprec.train._checkpoint import CheckpointError, newest_readable
from mixprec.train._names import AMP_LEVELS, MODEL_NAMES
from mixprec.train.callbacks import ModelCheckpoint

#: The files a run writes besides its checkpoints.
RUN_FILES = (
    "config.json",
    "metrics.json",
    "metrics.csv",
    "loss.png",
    "accuracy.png",
    "loss_scale.png",
)
#: The ``format`` entry of ``config.json``. 2: the validation part is carved from the
#: training data (format 1 trained on all of it), so a format-1 run cannot continue
#: exactly here and is refused.
RUN_FORMAT = "mixprec-run-2"
#: Checkpoints a run keeps: the newest two, so a corrupt newest one has a fallback.
KEEP_LAST = 2
#: Settings a resumed run takes from its folder; a given option must agree with them.
RESUMED = (
    "level", "dtype", "loss_scale", "model", "data", "batch_size", "lr", "seed", "fp8", "compile",
    "master_weights", "optimizer",
)  # fmt: skip
#: Settings added to ``config.json`` since its format was last changed, with the value
#: that a run written before them trained with: such a run stays resumable.
ADDED = {"master_weights": None, "optimizer": "adamw"}
#: The lock file that marks a run folder held by a process.
LOCK_NAME = ".mixprec.lock"


def _checkpoints(folder: Path) -> ModelCheckpoint:
    """The run's checkpoint files, as the run's ``ModelCheckpoint`` names them."""
    return ModelCheckpoint(folder / "checkpoints", keep_last=KEEP_LAST)


def links_in(folder: Path) -> list[Path]:
    """The run files of ``folder`` (``checkpoints/`` and the files in it included) that
    are symbolic links: writing or deleting through them would touch another folder."""
    if not folder.is_dir():
        return []
    found = [folder / name for name in (*RUN_FILES, "checkpoints") if (folder / name).is_symlink()]
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        found += [p for p in sorted(checkpoints.iterdir()) if p.is_symlink()]
    return found


def _link_text(link: Path) -> str:
    try:
        return f"{link} is a link to {os.readlink(link)}"
    except OSError:
        return f"{link} is a link"


def present_files(folder: Path, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` present in ``folder``; a link counts, dangling or not."""
    if not folder.is_dir():
        return []
    return [name for name in names if os.path.lexists(folder / name)]


def run_files(folder: Path) -> list[str]:
    """The names of a run's files present in ``folder`` (``checkpoints/`` if it has any);
    a link counts, dangling or not."""
    if not folder.is_dir():
        return []
    names = present_files(folder, RUN_FILES)
    if (folder / "checkpoints").is_symlink() or _checkpoints(folder).existing():
        names.append("checkpoints/")
    return names


def check_new_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, or that holds a run without ``--overwrite``."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; choose another path")
    present = run_files(out)
    if present and not overwrite:
        raise UsageError(
            f"--out {out} already holds a run ({', '.join(present)}): continue it with "
            f"--resume {out}, choose another --out, or pass --overwrite to replace it"
        )


def prepare_out(out: Path, overwrite: bool) -> None:
    """Create ``out`` and check it can be written; with ``overwrite`` delete the old run.

    Any failure is a :class:`UsageError` and leaves no folder behind that was not there.
    """
    if overwrite:  # the links themselves go, before anything is written through them
        for link in links_in(out):
            link.unlink()
    created = [p for p in (out / "checkpoints", out, *out.parents) if not p.exists()]
    try:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        # A file created and deleted at once: the only reliable test that it is writable.
        tempfile.NamedTemporaryFile(dir=out / "checkpoints").close()
    except OSError as err:
        for folder in created:
            with contextlib.suppress(OSError):  # best effort: a folder may not be empty
                folder.rmdir()
        reason = err.strerror or type(err).__name__
        raise UsageError(f"--out {out}: cannot write there ({reason})") from None
    if overwrite:
        keeper = _checkpoints(out)
        for stale in [*keeper.existing(), *keeper.directory.glob("*.tmp")]:
            stale.unlink()  # a link is deleted itself, never what it points to
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)


def read_config(folder: Path) -> dict[str, Any]:
    """The settings in ``folder/config.json``; a :class:`UsageError` if there are none."""
    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"--resume {folder}: not a mixprec run folder (no config.json there)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--resume {folder}: config.json is unreadable ({err})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--resume {folder}: config.json lacks settings")
    config = {**ADDED, **config}
    if config.get("format") != RUN_FORMAT:
        found = "no format" if "format" not in config else f"format {config['format']!r}"
        raise UsageError(
            f"--resume {folder}: its config.json has {found}; this version of mixprec "
            f"reads {RUN_FORMAT!r}: resume it with the version that wrote it"
        )
    missing = [k for k in (*RESUMED, "amp_level", "epochs") if k not in config]
    if missing:
        raise UsageError(f"--resume {folder}: config.json lacks {', '.join(missing)}")
    for key, value in config.items():
        check = _SETTINGS.get(key)
        if check is not None and not check[0](value):
            raise UsageError(
                f"--resume {folder}: {path} has {key} {json.dumps(value)}, expected "
                f"{check[1]}; correct it, or start a new run with --out"
            )
    return config


def _whole(minimum: int | None, optional: bool = False) -> Any:
    def ok(v: Any) -> bool:
        if v is None:
            return optional
        return isinstance(v, int) and not isinstance(v, bool) and (minimum is None or v >= minimum)

    return ok


def _scale_ok(v: Any) -> bool:
    if v in ("dynamic", "none"):
        return True
    try:
        number = float(v)
    except (TypeError, ValueError):
        return False
    return isinstance(v, str) and 0 < number < math.inf


def _number_ok(v: Any, top: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= top


#: What each setting of ``config.json`` must be (a hand-edited file is refused by name).
_SETTINGS: dict[str, tuple[Any, str]] = {
    "level": (lambda v: v in AMP_LEVELS, f"one of {', '.join(AMP_LEVELS)}"),
    "amp_level": (lambda v: v in AMP_LEVELS and v != "auto", "a level"),
    "dtype": (lambda v: v in ("float16", "bfloat16", "float32"), "float16 or bfloat16"),
    "loss_scale": (_scale_ok, "'dynamic', 'none' or a positive number (as text)"),
    "model": (lambda v: v in MODEL_NAMES, f"one of {', '.join(MODEL_NAMES)}"),
    "data": (lambda v: v is None or (isinstance(v, str) and v != ""), "a path or null"),
    "epochs": (_whole(1), "a positive whole number"),
    "batch_size": (_whole(1), "a positive whole number"),
    "lr": (lambda v: _number_ok(v, LR_MAX), f"a positive number up to {LR_MAX:g}"),
    "seed": (_whole(None), "a whole number"),
    "device": (lambda v: v is None or (isinstance(v, str) and v != ""), "a device or null"),
    "threads": (_whole(1, optional=True), "a positive whole number or null"),
    "compile": (lambda v: isinstance(v, bool), "true or false"),
    "fp8": (lambda v: v is None or v in FP8_RECIPES, f"null or one of {', '.join(FP8_RECIPES)}"),
    "master_weights": (
        lambda v: v is None or v in MASTER_WEIGHTS,
        f"null (the level's own) or one of {', '.join(MASTER_WEIGHTS)}",
    ),
    "optimizer": (lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
    "max_skipped_fraction": (
        lambda v: v is None or _number_ok(v, 1.0),
        "a number in (0, 1] or null",
    ),
}


def _same(key: str, given: Any, saved: Any) -> bool:
    if key == "dtype":
        return as_dtype(given) == as_dtype(saved)
    if key == "data":
        return saved is not None and Path(given).resolve() == Path(saved).resolve()
    words = ("dynamic", "none")
    if key in ("lr", "loss_scale") and given not in words and saved not in words:
        return float(given) == float(saved)
    return given == saved


def resume_settings(args: argparse.Namespace, given: set[str]) -> argparse.Namespace:
    """``args`` with the resumed run's settings; a :class:`UsageError` names the first
    given option that contradicts them."""
    folder = args.resume
    if "overwrite" in given:
        raise UsageError(
            f"--overwrite contradicts --resume {folder}: a resumed run continues its folder; "
            "to start over, pass --out DIR --overwrite without --resume"
        )
    if "out" in given and args.out.resolve() != folder.resolve():
        raise UsageError(
            f"--out {args.out} contradicts --resume {folder}: a resumed run continues in its "
            "own folder; leave --out out"
        )
    saved = read_config(folder)
    links = links_in(folder)
    if links:
        raise UsageError(
            f"--resume {folder}: {_link_text(links[0])}; a run folder must hold its own "
            "files, or the run would write into another folder: replace the link with a "
            "copy (cp -L) to resume"
        )
    for key in RESUMED:
        if key in given and not _same(key, getattr(args, key), saved[key]):
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"{flag} {getattr(args, key)} contradicts the run in {folder} ({key} "
                f"{saved[key]}): a resumed run keeps its settings; leave {flag} out, or start "
                "a new run with --out"
            )
    for key in RESUMED:
        setattr(args, key, saved[key])
    if args.dtype == "float32":  # an O0 run (e.g. auto on a CPU without bfloat16 units)
        args.dtype = None
    args.requested_level = saved["level"]
    args.level = saved["amp_level"]  # "auto" as it was resolved
    args.data = None if saved["data"] is None else Path(saved["data"])
    # Free to change, the run's own by default.
    for key in ("epochs", "device", "threads", "max_skipped_fraction"):
        if key not in given:
            setattr(args, key, saved.get(key))
    args.out = folder
    return args


def pick_checkpoint(folder: Path, device: torch.device) -> tuple[Path, int, str | None]:
    """The newest checkpoint in ``folder`` that reads safely, its epoch, and a warning
    line naming the corrupt ones skipped (``None`` if none were)."""
    newest_first = _checkpoints(folder).existing()[::-1]
    skipped: list[CheckpointError] = []
    try:
        found = newest_readable(newest_first, device, on_skip=lambda _, err: skipped.append(err))
    except CheckpointError as err:  # unsafe, or a format this version does not read
        raise UsageError(str(err)) from None
    if found is None:
        why = f"; {skipped[0]}" if skipped else ""
        raise UsageError(f"--resume {folder}: no readable checkpoint in checkpoints/{why}")
    path, payload = found
    warning = None
    if skipped:
        warning = f"{'; '.join(map(str, skipped))}; resuming from {path.name} instead"
    return path, int(payload["epoch"]), warning


class RunLock:
    """One process at a time in a run folder: an ``flock`` on ``folder/.mixprec.lock``.

    The operating system releases the lock when the process exits or dies, so a crash
    never leaves a folder locked; :meth:`release` also deletes the file. A second
    process is refused with a :class:`UsageError` naming the holder's pid (written in
    the file). Folders :meth:`acquire` had to create are removed again by
    ``release(remove_created=True)`` (a run refused before writing anything).
    """

    def __init__(self, folder: Path, flag: str) -> None:
        self.folder, self.flag = folder, flag
        self.path = folder / LOCK_NAME
        self.fd: int | None = None
        self.created: list[Path] = []

    def acquire(self) -> RunLock:
        import fcntl

        self.created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self._remove_created()
            reason = err.strerror or type(err).__name__
            raise UsageError(f"{self.flag} {self.folder}: cannot write there ({reason})") from None
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as err:
                self._remove_created()
                if err.errno == errno.ELOOP:
                    raise UsageError(
                        f"{self.flag} {self.folder}: {LOCK_NAME} is a link; remove it"
                    ) from None
                reason = err.strerror or type(err).__name__
                raise UsageError(
                    f"{self.flag} {self.folder}: cannot write there ({reason})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read_pid(fd)
                os.close(fd)
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                who = f"process {holder}" if holder else "another process"
                raise UsageError(
                    f"{self.flag} {self.folder}: the run folder is in use by mixprec {who}; "
                    "wait for it to finish (or stop it), or choose another folder"
                ) from None
            # The holder before us may have deleted the file after we opened it: retry.
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self, remove_created: bool = False) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held: a waiting process retries on the new file
        os.close(self.fd)
        self.fd = None
        if remove_created:
            self._remove_created()

    def _remove_created(self) -> None:
        for folder in self.created:  # deepest first
            with contextlib.suppress(OSError):  # best effort: a folder may not be empty
                folder.rmdir()
        self.created = []


def _read_pid(fd: int) -> str | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.isdigit() else None
