"""Shared checks for labelled data: the ``DataError`` type and array validation.

Every loader funnels its arrays through :func:`check_arrays`, so a file from disk
and an array built in memory are held to the same rules and fail with the same
one-line messages.

>>> import numpy as np
>>> x, y = check_arrays(np.zeros((3, 4)), np.array([0, 2, 1]), source="demo")
>>> x.dtype, y.dtype, y.tolist()
(torch.float32, torch.int64, [0, 2, 1])
>>> check_arrays(np.zeros((2, 4)), np.array([0, -1]), source="demo")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mixprec.train.data.DataError: demo: labels must be >= 0, got -1 (at sample 1); ...
"""

from __future__ import annotations

import numpy as np
import torch


class DataError(ValueError):
    """Raised when a data set is missing, malformed or has invalid labels.

    It is a ``ValueError``, so generic handlers still work, and a single class the
    command line can catch to print one line instead of a traceback.

    >>> issubclass(DataError, ValueError)
    True
    """


# Shown in tracebacks as ``mixprec.train.data.DataError``: the public home of the class.
DataError.__module__ = "mixprec.train.data"


class DataFileNotFoundError(DataError, FileNotFoundError):
    """Raised when a data file does not exist; also a ``FileNotFoundError``.

    >>> issubclass(DataFileNotFoundError, FileNotFoundError)
    True
    """


DataFileNotFoundError.__module__ = "mixprec.train.data"


def _labels_from_onehot(y: np.ndarray, source: str) -> np.ndarray:
    # One-hot rows (the form MindSpore's SoftmaxCrossEntropyWithLogits examples use)
    # are accepted only when every row has exactly one 1 and zeros elsewhere, so a
    # matrix of probabilities or garbage is never silently argmax-ed into labels.
    is_binary = np.isin(y, (0, 1)).all()
    rows_ok = is_binary and bool((y.sum(axis=1) == 1).all())
    if not rows_ok:
        raise DataError(
            f"{source}: 2-D labels y of shape {tuple(y.shape)} must be one-hot (each row "
            "exactly one 1, zeros elsewhere); pass class indices of shape (N,) instead"
        )
    return y.argmax(axis=1)


#: Without ``num_classes``, labels may imply at most this many classes, or twice the
#: number of samples if that is more: a larger label is an id, a year or a price, not a
#: class index, and would build an enormous output layer (label 10**6: a million
#: outputs) whose classes could never all be seen.
MIN_CLASS_LIMIT = 1000


def _check_label_range(y: np.ndarray, source: str) -> None:
    limit = max(MIN_CLASS_LIMIT, 2 * y.shape[0])
    if y.shape[0] and int(y.max()) + 1 > limit:
        i = int(np.argmax(y))
        raise DataError(
            f"{source}: label {int(y[i])} (at sample {i}) implies {int(y[i]) + 1} classes for "
            f"{y.shape[0]} samples (at most {limit} without num_classes); labels must be "
            "class indices 0..C-1: renumber them, e.g. numpy.unique(y, return_inverse=True)"
        )


def check_arrays(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    source: str = "data",
    num_classes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate features and labels and return them as float32 / int64 tensors.

    ``x`` has shape ``(N, ...)`` with numbers finite in float32 (the dtype returned); ``y`` holds ``N`` class indices
    (integers, or floats with integral values) or ``N`` one-hot rows. Labels must be
    ``>= 0`` and, when ``num_classes`` is given, ``< num_classes``; without it, they may
    imply at most ``max(1000, 2 * N)`` classes. Raises :class:`DataError` naming
    ``source`` otherwise.

    >>> x, y = check_arrays([[1.0], [2.0]], np.array([[0, 1], [1, 0]]), num_classes=2)
    >>> y.tolist()
    [1, 0]
    """
    x_np = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)
    y_np = np.asarray(y.detach().cpu() if isinstance(y, torch.Tensor) else y)
    if x_np.dtype.kind not in "biuf":
        raise DataError(
            f"{source}: features x must be numeric, got dtype {x_np.dtype}; "
            "convert them to numbers before loading"
        )
    if x_np.ndim < 2:
        raise DataError(
            f"{source}: features x must have shape (N, features...), got shape "
            f"{tuple(x_np.shape)}; add a feature axis, e.g. x.reshape(-1, 1)"
        )
    if x_np.shape[0] == 0:
        raise DataError(f"{source}: the data set is empty (0 samples); it needs at least one")
    if x_np.dtype.kind == "f" and not np.isfinite(x_np).all():
        bad = int(np.argwhere(~np.isfinite(x_np))[0][0])
        raise DataError(
            f"{source}: features x contain NaN or infinity (first at sample {bad}); "
            "remove or impute those values"
        )
    if x_np.dtype.kind == "f" and x_np.dtype.itemsize > 4:
        # Checked in float32, the dtype the features are trained in: 1e39 is finite in
        # float64 and infinite in float32, so every batch holding it would be skipped.
        too_big = np.abs(x_np) > np.finfo(np.float32).max
        if too_big.any():
            where = tuple(np.argwhere(too_big)[0])
            raise DataError(
                f"{source}: features x hold {float(x_np[where]):g} (first at sample "
                f"{where[0]}), beyond float32's range ({float(np.finfo(np.float32).max):g}), "
                "the dtype training uses; rescale the features (e.g. standardise them)"
            )
    if y_np.dtype.kind not in "biuf":
        raise DataError(
            f"{source}: labels y must be integer class indices, got dtype {y_np.dtype}; "
            "map class names to 0..C-1 first"
        )
    if y_np.ndim == 2 and y_np.shape[1] > 1:
        y_np = _labels_from_onehot(y_np, source)
    elif y_np.ndim == 2 and y_np.shape[1] == 1:
        y_np = y_np[:, 0]
    if y_np.ndim != 1:
        raise DataError(
            f"{source}: labels y must have shape (N,) or one-hot (N, C), got shape "
            f"{tuple(y_np.shape)}"
        )
    if y_np.shape[0] != x_np.shape[0]:
        raise DataError(
            f"{source}: x has {x_np.shape[0]} samples but y has {y_np.shape[0]} labels; "
            "they must have the same length"
        )
    if y_np.dtype.kind == "f":
        not_int = ~np.isfinite(y_np) | (y_np != np.round(y_np))
        if not_int.any():
            i = int(np.argmax(not_int))
            raise DataError(
                f"{source}: labels must be whole numbers, got {float(y_np[i]):g} (at sample {i}); "
                "use class indices 0..C-1"
            )
    if (y_np < 0).any():
        i = int(np.argmax(y_np < 0))
        raise DataError(
            f"{source}: labels must be >= 0, got {y_np[i]:g} (at sample {i}); "
            "use class indices 0..C-1"
        )
    if num_classes is None:
        _check_label_range(y_np, source)
    elif (y_np >= num_classes).any():
        i = int(np.argmax(y_np >= num_classes))
        raise DataError(
            f"{source}: label {y_np[i]:g} (at sample {i}) is out of range for "
            f"num_classes={num_classes}; labels must be in 0..{num_classes - 1}"
        )
    x_t = torch.from_numpy(np.ascontiguousarray(x_np, dtype=np.float32))
    y_t = torch.from_numpy(np.ascontiguousarray(y_np).astype(np.int64))
    return x_t, y_t


def infer_num_classes(y: torch.Tensor | np.ndarray) -> int:
    """Return the number of classes implied by labels: ``max(y) + 1``.

    Class indices are assumed to run from 0, so a class that never occurs below the
    largest label still counts. One-hot labels ``(N, C)`` give ``C``.

    >>> infer_num_classes(torch.tensor([0, 3, 1]))
    4
    >>> infer_num_classes(torch.eye(5))
    5
    """
    y_np = np.asarray(y.detach().cpu() if isinstance(y, torch.Tensor) else y)
    if y_np.ndim == 2 and y_np.shape[1] > 1:
        return int(y_np.shape[1])
    if y_np.size == 0:
        raise DataError("cannot infer the number of classes from an empty label array")
    top = y_np.max()
    if y_np.min() < 0 or top != np.round(top):
        raise DataError(
            f"labels must be non-negative whole numbers to infer the number of classes; "
            f"got values in [{y_np.min():g}, {top:g}]"
        )
    return int(top) + 1
