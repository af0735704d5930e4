"""Load user data sets from ``.npz`` and ``.csv`` files, validated.

Both loaders return ``(x, y)`` as float32 features (values as stored, not rescaled)
and int64 class indices, and raise :class:`~mixprec.train.data.DataError` with a one-line
message for a missing file, a malformed file or invalid labels.

CSV layout: one sample per line, comma-separated numbers. If the first line has a
field that is not a number, it is a header; the label column is then the one named
``label`` (any case), or the last column when no column has that name. A first line of
column numbers (``0,1,...,n-1`` or ``1,...,n``) is read as a header too, with a warning. Without a
header the last column is the label. Every other column is a feature.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "toy.csv")
>>> _ = open(p, "w").write("label,a,b\\n1,0.5,2\\n0,1.5,3\\n")
>>> x, y = load_csv(p)
>>> x.tolist(), y.tolist()
([[0.5, 2.0], [1.5, 3.0]], [1, 0])
"""

from __future__ import annotations

import csv
import os
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

from mixprec._checks import check_instance

from ._validate import DataError, DataFileNotFoundError, check_arrays

#: Name of the label column in a CSV file with a header (compared case-insensitively).
LABEL_COLUMN = "label"


def _existing_file(path: str | os.PathLike[str], kind: str) -> Path:
    check_instance(
        "path",
        path,
        (str, os.PathLike),
        "a str or os.PathLike",
        hint=f"pass the {kind} file's name",
    )
    p = Path(path)
    if not p.exists():
        raise DataFileNotFoundError(f"{kind} file not found: {str(p)!r}; check the path")
    if not p.is_file():
        raise DataError(f"{kind} path {str(p)!r} is not a file; pass a {kind} file")
    return p


def load_npz(
    path: str | os.PathLike[str], *, num_classes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load features ``x`` and labels ``y`` from a NumPy ``.npz`` archive.

    ``x`` is ``(N, ...)`` numbers; ``y`` is ``(N,)`` class indices or ``(N, C)``
    one-hot rows. Other arrays in the archive are ignored. With ``num_classes``,
    labels must be below it. Pickled objects are never loaded.

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "toy.npz")
    >>> np.savez(p, x=np.ones((2, 3)), y=np.array([0, 1]))
    >>> x, y = load_npz(p)
    >>> tuple(x.shape), y.tolist()
    ((2, 3), [0, 1])
    >>> np.savez(p, features=np.ones((2, 3)))
    >>> load_npz(p)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mixprec.train.data.DataError: ...: missing array(s) 'x', 'y'; found: 'features'; ...
    """
    p = _existing_file(path, "npz")
    source = str(p)
    try:
        loaded = np.load(p, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(
            f"{source}: not a readable .npz archive ({exc}); save one with "
            "numpy.savez(path, x=features, y=labels)"
        ) from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(
            f"{source}: holds a single array, not an .npz archive; save one with "
            "numpy.savez(path, x=features, y=labels)"
        )
    with loaded as archive:
        names = list(archive.files)
        missing = [k for k in ("x", "y") if k not in names]
        if missing:
            found = ", ".join(repr(n) for n in names) or "no arrays"
            raise DataError(
                f"{source}: missing array(s) {', '.join(repr(m) for m in missing)}; "
                f"found: {found}; save with numpy.savez(path, x=features, y=labels)"
            )
        try:
            x, y = archive["x"], archive["y"]
        except ValueError as exc:
            # Object arrays need pickle, which is refused for safety.
            raise DataError(
                f"{source}: arrays 'x'/'y' could not be read without pickle ({exc}); "
                "store plain numeric arrays"
            ) from exc
    return check_arrays(x, y, source=source, num_classes=num_classes)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _column_numbers(row: list[str]) -> bool:
    """A first row ``0,1,...,n-1`` or ``1,2,...,n`` (n >= 3): column numbers, as pandas
    writes them, not a sample (its label would be the largest number in the file)."""
    try:
        values = [float(field) for field in row]
    except ValueError:
        return False
    start = values[0] if values else -1
    return (
        len(values) >= 3 and start in (0, 1) and values == [start + i for i in range(len(values))]
    )


def load_csv(
    path: str | os.PathLike[str], *, num_classes: int | None = None, delimiter: str = ","
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a CSV file of numeric rows; the label column is ``label`` or the last one.

    See the module docstring for the header rule. Blank lines are skipped; a row
    with the wrong number of fields or a non-numeric value raises
    :class:`~mixprec.train.data.DataError` naming the line and column.

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "toy.csv")
    >>> _ = open(p, "w").write("0.5,2,1\\n1.5,3,0\\n")
    >>> x, y = load_csv(p)
    >>> x.tolist(), y.tolist()
    ([[0.5, 2.0], [1.5, 3.0]], [1, 0])
    """
    p = _existing_file(path, "csv")
    source = str(p)
    with p.open(newline="", encoding="utf-8-sig") as f:
        rows = [(n, row) for n, row in enumerate(csv.reader(f, delimiter=delimiter), 1) if row]
    if not rows:
        raise DataError(f"{source}: the file is empty; it needs one sample per line")
    header: list[str] | None = None
    _, first = rows[0]
    numbered = _column_numbers(first) and len(rows) > 1
    if numbered:
        warnings.warn(
            f"{source}: line 1 ({','.join(f.strip() for f in first[:3])},...,{first[-1].strip()}) "
            "numbers the columns; it is read as a header, not as a sample",
            UserWarning,
            stacklevel=2,
        )
    if numbered or not all(_is_number(field) for field in first):
        header = [field.strip() for field in first]
        rows = rows[1:]
        if not rows:
            raise DataError(f"{source}: has a header but no data rows")
    width = len(header) if header is not None else len(rows[0][1])
    if width < 2:
        raise DataError(
            f"{source}: needs at least 2 columns (features and a label), got {width}; "
            f"separate fields with {delimiter!r}"
        )
    label_col = width - 1
    if header is not None:
        lowered = [h.lower() for h in header]
        if LABEL_COLUMN in lowered:
            label_col = lowered.index(LABEL_COLUMN)
    values = np.empty((len(rows), width), dtype=np.float64)
    for i, (line, row) in enumerate(rows):
        if len(row) != width:
            raise DataError(
                f"{source}: line {line} has {len(row)} fields, expected {width}; "
                "every row needs the same columns"
            )
        for j, field in enumerate(row):
            try:
                values[i, j] = float(field)
            except ValueError:
                column = repr(header[j]) if header is not None else str(j + 1)
                raise DataError(
                    f"{source}: line {line}, column {column}: {field!r} is not a number"
                ) from None
    y = values[:, label_col]
    x = np.delete(values, label_col, axis=1)
    return check_arrays(x, y, source=source, num_classes=num_classes)
