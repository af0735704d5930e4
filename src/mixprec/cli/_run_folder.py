"""Run folders: what ``mixprec train`` keeps in ``--out``, and the rules that keep two
runs from ever mixing in one folder.

A run folder holds :data:`RUN_FILES` and ``checkpoints/epochNNNN.pt``. ``config.json``
records the run's settings (data path absolute, level and dtype as resolved), so
``--resume DIR`` rebuilds exactly the run that wrote it, from any working directory.

* A new run refuses an ``--out`` that already holds a run, unless ``--overwrite``
  (then the old run's files are deleted first, and only the new run's remain); an
  ``--out`` that cannot be created or written is refused before anything is written.
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
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from mixprec._checks import as_dtype
from mixprec.cli._args import UsageError
from mixprec.train._checkpoint import CheckpointError, newest_readable
from mixprec.train.callbacks import ModelCheckpoint

__all__ = [
    "RUN_FILES",
    "RUN_FORMAT",
    "run_files",
    "check_new_out",
    "prepare_out",
    "read_config",
    "resume_settings",
    "pick_checkpoint",
    "KEEP_LAST",
]

#: The files a run writes besides its checkpoints.
RUN_FILES = (
    "config.json",
    "metrics.json",
    "metrics.csv",
    "loss.png",
    "accuracy.png",
    "loss_scale.png",
)
#: The ``format`` entry of ``config.json``.
RUN_FORMAT = "mixprec-run-1"
#: Checkpoints a run keeps: the newest two, so a corrupt newest one has a fallback.
KEEP_LAST = 2
#: Settings a resumed run takes from its folder; a given option must agree with them.
RESUMED = ("level", "dtype", "loss_scale", "model", "data", "batch_size", "lr", "seed", "fp8")


def _checkpoints(folder: Path) -> ModelCheckpoint:
    """The run's checkpoint files, as the run's ``ModelCheckpoint`` names them."""
    return ModelCheckpoint(folder / "checkpoints", keep_last=KEEP_LAST)


def run_files(folder: Path) -> list[str]:
    """The names of a run's files present in ``folder`` (``checkpoints/`` if it has any)."""
    if not folder.is_dir():
        return []
    names = [name for name in RUN_FILES if (folder / name).exists()]
    if _checkpoints(folder).existing():
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
            stale.unlink()
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
    if config.get("format") != RUN_FORMAT:
        found = "no format" if "format" not in config else f"format {config['format']!r}"
        raise UsageError(
            f"--resume {folder}: its config.json has {found}; this version of mixprec "
            f"reads {RUN_FORMAT!r}: resume it with the version that wrote it"
        )
    missing = [k for k in (*RESUMED, "amp_level", "epochs") if k not in config]
    if missing:
        raise UsageError(f"--resume {folder}: config.json lacks {', '.join(missing)}")
    return config


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
    args.requested_level = saved["level"]
    args.level = saved["amp_level"]  # "auto" as it was resolved
    args.data = None if saved["data"] is None else Path(saved["data"])
    for key in ("epochs", "device", "threads"):  # free to change, the run's own by default
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
