"""Seeded ``DataLoader`` construction for in-memory tensors.

Shuffling draws from the loader's own ``torch.Generator`` seeded with ``seed``, so
two runs with the same seed see the same batches in the same order, whatever else
uses the global random state. To resume a run mid-way with the same order, save
``loader.generator.get_state()`` in the checkpoint and restore it with
``loader.generator.set_state(...)``.

>>> x, y = torch.arange(6.0).unsqueeze(1), torch.tensor([0, 1, 0, 1, 0, 1])
>>> a = [b[1].tolist() for b in make_loaders(x, y, batch_size=4, seed=3)]
>>> b = [b[1].tolist() for b in make_loaders(x, y, batch_size=4, seed=3)]
>>> a == b, [len(batch) for batch in a]
(True, [4, 2])
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec._checks import check_instance, check_number

from ._digits import _check_seed, load_digits, stratified_split
from ._validate import DataError

#: The share of the training part :func:`train_val_test_loaders` holds out for validation.
VAL_FRACTION = 0.1


def _check_batch_size(name: str, value: int) -> int:
    return check_number(name, value, integer=True, minimum=1, hint=f"pass e.g. {name}=64")


def make_loaders(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    *,
    drop_last: bool = False,
    pin_memory: bool = False,
) -> DataLoader:
    """Wrap tensors ``x``, ``y`` in a ``DataLoader`` whose shuffling is seeded.

    Batches are ``(x_batch, y_batch)``. Data stays in the main process (the
    tensors are already in memory, so worker processes would only add start-up
    time). ``pin_memory=True`` speeds up host-to-GPU copies.

    >>> loader = make_loaders(torch.zeros(10, 3), torch.zeros(10, dtype=torch.long), 4)
    >>> len(loader), loader.batch_size
    (3, 4)
    """
    for name, value in (("x", x), ("y", y)):
        check_instance(
            name,
            value,
            torch.Tensor,
            "a torch.Tensor",
            hint="load data with mixprec.train.data.load_digits/load_npz/load_csv "
            "or torch.as_tensor",
        )
    if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x and y must have the same number of samples, got x.shape={tuple(x.shape)} "
            f"and y.shape={tuple(y.shape)}"
        )
    batch_size = _check_batch_size("batch_size", batch_size)
    generator = torch.Generator().manual_seed(_check_seed(seed))
    return DataLoader(
        TensorDataset(x, y),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        drop_last=drop_last,
        pin_memory=pin_memory,
    )


def _check_split_args(
    x: torch.Tensor | None, y: torch.Tensor | None, batch_size: int, eval_batch_size: int | None
) -> int:
    """The loader functions' shared checks; returns the evaluation batch size."""
    if (x is None) != (y is None):
        raise ValueError(
            "pass both x and y to split your own data, or neither to use the digits; "
            f"got x={'None' if x is None else 'a tensor'}, y={'None' if y is None else 'a tensor'}"
        )
    _check_batch_size("batch_size", batch_size)
    eval_bs = batch_size if eval_batch_size is None else eval_batch_size
    _check_batch_size("eval_batch_size", eval_bs)
    return eval_bs


def train_test_loaders(
    x: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    *,
    batch_size: int = 64,
    eval_batch_size: int | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    image: bool = True,
    pin_memory: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """Return ``(train_loader, test_loader)`` for the digits or for ``x``, ``y``.

    Without ``x`` and ``y`` the embedded digits are used (``image`` picks the
    ``(N, 1, 8, 8)`` or ``(N, 64)`` layout). With them, they are split by
    :func:`stratified_split`. ``seed`` fixes both the split and the shuffling.
    The train loader shuffles; the test loader keeps order and uses
    ``eval_batch_size`` (default: ``batch_size``).

    >>> train, test = train_test_loaders(batch_size=128)
    >>> len(train.dataset), len(test.dataset), len(train)
    (1438, 359, 12)
    """
    eval_bs = _check_split_args(x, y, batch_size, eval_batch_size)
    if x is None or y is None:
        train = load_digits("train", test_fraction=test_fraction, seed=seed, image=image)
        test = load_digits("test", test_fraction=test_fraction, seed=seed, image=image)
    else:
        train, test = stratified_split(x, y, test_fraction=test_fraction, seed=seed)
    train_loader = make_loaders(*train, batch_size, shuffle=True, seed=seed, pin_memory=pin_memory)
    test_loader = make_loaders(*test, eval_bs, shuffle=False, seed=seed, pin_memory=pin_memory)
    return train_loader, test_loader


def train_val_test_loaders(
    x: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    *,
    batch_size: int = 64,
    eval_batch_size: int | None = None,
    val_fraction: float = VAL_FRACTION,
    test_fraction: float = 0.2,
    seed: int = 0,
    image: bool = True,
    pin_memory: bool = False,
) -> tuple[DataLoader, DataLoader, DataLoader]:
    """Return ``(train_loader, val_loader, test_loader)``: validation carved from training.

    The test part is the one :func:`train_test_loaders` holds out (same ``test_fraction``
    and ``seed``); ``val_fraction`` of the rest, per class, becomes the validation part
    (a second :func:`stratified_split` of the training part, with the same ``seed``), so
    choices made on validation numbers never see the test set. The three parts are
    disjoint and depend only on the labels, the fractions and ``seed``. The validation
    and test loaders keep order and use ``eval_batch_size`` (default: ``batch_size``).

    >>> train, val, test = train_val_test_loaders(batch_size=128)
    >>> len(train.dataset), len(val.dataset), len(test.dataset)
    (1293, 145, 359)
    """
    eval_bs = _check_split_args(x, y, batch_size, eval_batch_size)
    fraction = check_number("val_fraction", val_fraction, hint="pass e.g. val_fraction=0.1")
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"val_fraction must be a number in (0, 1), got {val_fraction!r}; pass e.g. "
            "val_fraction=0.1 to validate on 10% of the training part"
        )
    if x is None or y is None:
        rest = load_digits("train", test_fraction=test_fraction, seed=seed, image=image)
        test = load_digits("test", test_fraction=test_fraction, seed=seed, image=image)
    else:
        rest, test = stratified_split(x, y, test_fraction=test_fraction, seed=seed)
    try:
        train, val = stratified_split(*rest, test_fraction=fraction, seed=seed)
    except DataError:
        raise DataError(
            f"{len(rest[1])} training samples are too few to hold out a validation part "
            f"(val_fraction={fraction}) and keep some to train on; use more data"
        ) from None
    train_loader = make_loaders(*train, batch_size, shuffle=True, seed=seed, pin_memory=pin_memory)
    val_loader = make_loaders(*val, eval_bs, shuffle=False, seed=seed, pin_memory=pin_memory)
    test_loader = make_loaders(*test, eval_bs, shuffle=False, seed=seed, pin_memory=pin_memory)
    return train_loader, val_loader, test_loader
