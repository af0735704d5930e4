"""Writing a run's files safely: whole or not at all, never through a symbolic link,
and under a temporary name no other process uses.

:func:`atomic_write` writes to ``.<name>.<pid>.<n>.tmp`` beside the file (created with
``O_EXCL | O_NOFOLLOW``, so it is a new file of this process and never a link), flushes
it, then renames it over the real name: a crash mid-write leaves the old file (or none),
and a link in the file's place is replaced by the file, never written through. A failed
write removes its temporary file and raises the ``OSError`` with the real file's name
(``no space left on device`` names the checkpoint, not a temporary name).

:func:`append_text` appends to a file that must not be a link (``O_NOFOLLOW``).

>>> import os, tempfile
>>> folder = tempfile.mkdtemp()
>>> target = os.path.join(folder, "elsewhere.txt")
>>> os.symlink(target, os.path.join(folder, "run.txt"))
>>> atomic_write(os.path.join(folder, "run.txt"), lambda f: f.write(b"mine"))
>>> os.path.islink(os.path.join(folder, "run.txt")), os.path.exists(target)
(False, False)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

_counter = itertools.count()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def temp_name(path: Path) -> Path:
    """A temporary name beside ``path`` that no other process (or call) uses."""
    return path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.tmp")


def named_oserror(err: OSError, path: Path | str) -> OSError:
    """``err`` naming ``path`` (the real file, not a temporary one)."""
    if err.errno is None:
        return err
    named = OSError(err.errno, os.strerror(err.errno), str(path))
    named.__cause__ = err
    return named


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any], fsync: bool = True) -> None:
    """Write ``path`` whole through ``write(file)``, or leave it as it was.

    ``write`` gets a binary file open on a temporary name beside ``path``
    (``.<name>.<pid>.<n>.tmp``: a new file of this process, never a link); once it
    returns, the file is flushed (and with ``fsync`` synced to disk) and renamed over
    ``path``. If ``write`` raises or the disk fills, the temporary file is removed,
    ``path`` is as it was, and an ``OSError`` names ``path``. A symbolic link at
    ``path`` is replaced by the file, never written through.

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "summary.json")
    >>> atomic_write(path, lambda f: f.write(json.dumps({"accuracy": 0.9}).encode()))
    >>> def fails(f):
    ...     f.write(b"half of it")
    ...     raise RuntimeError("interrupted")
    >>> try:
    ...     atomic_write(path, fails)
    ... except RuntimeError:
    ...     pass
    >>> open(path).read(), os.listdir(os.path.dirname(path))
    ('{"accuracy": 0.9}', ['summary.json'])
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
    except OSError as err:
        raise named_oserror(err, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())  # the rename below must never expose unwritten bytes
        os.replace(tmp, path)  # replaces a link in path's place; never follows it
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise named_oserror(err, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def append_text(path: str | Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing); refuse to follow a link there."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise named_oserror(err, path) from None
