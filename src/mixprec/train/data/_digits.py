"""The embedded 8x8 handwritten digits data set and a seeded stratified split.

The 1,797 images (UCI "Optical Recognition of Handwritten Digits", CC BY 4.0; see
``LICENSE-digits.txt`` next to this module) ship inside the package as a 45 kB
uint8 archive, so training examples and tests run with no download.

>>> x, y = load_digits("all")
>>> tuple(x.shape), x.dtype, float(x.max()), y.bincount().tolist()
((1797, 1, 8, 8), torch.float32, 1.0, [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])
"""

from __future__ import annotations

import functools
from importlib import resources

import numpy as np
import torch

from mixprec._checks import check_choice, check_instance, check_number

from ._validate import DataError

#: Number of classes in the digits data set (the digits 0..9).
DIGITS_NUM_CLASSES = 10
#: Largest pixel value in the digits data set: each pixel counts "on" bits in a 4x4 block.
DIGITS_MAX_PIXEL = 16

_SPLITS = ("train", "test", "all")


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    # Read once per process: every epoch-level caller gets fresh tensors built from
    # these read-only arrays, so nobody can corrupt the cached copy.
    with resources.files(__package__).joinpath("digits.npz").open("rb") as f:
        with np.load(f, allow_pickle=False) as archive:
            x, y = archive["x"], archive["y"]
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


_FRACTION_HINT = "pass e.g. test_fraction=0.2 to hold out 20% of the samples"


def _check_fraction(test_fraction: float) -> float:
    fraction = check_number("test_fraction", test_fraction, hint=_FRACTION_HINT)
    if not 0.0 < fraction < 1.0:  # both ends open: check_number's maximum is inclusive
        raise ValueError(
            f"test_fraction must be a number in (0, 1), got {test_fraction!r}; {_FRACTION_HINT}"
        )
    return fraction


def _check_seed(seed: int) -> int:
    return check_number("seed", seed, integer=True, hint="pass e.g. seed=0")


def stratified_split(
    x: torch.Tensor, y: torch.Tensor, test_fraction: float = 0.2, seed: int = 0
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Split ``(x, y)`` into train and test parts with the same class proportions.

    From each class, ``round(count * test_fraction)`` samples chosen by a
    ``torch.Generator`` seeded with ``seed`` go to the test part. The split depends
    only on ``y``, ``test_fraction`` and ``seed``, never on global random state, and
    both parts keep the original sample order.

    >>> x = torch.arange(10.0).unsqueeze(1)
    >>> y = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    >>> (x_tr, y_tr), (x_te, y_te) = stratified_split(x, y, test_fraction=0.4, seed=0)
    >>> y_tr.tolist(), y_te.tolist()
    ([0, 0, 0, 1, 1, 1], [0, 0, 1, 1])
    """
    test_fraction = _check_fraction(test_fraction)
    seed = _check_seed(seed)
    for name, value in (("x", x), ("y", y)):
        check_instance(
            name, value, torch.Tensor, "a torch.Tensor", hint="convert with torch.as_tensor"
        )
    if y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"y must be 1-D class indices with one label per row of x, got x.shape="
            f"{tuple(x.shape)} and y.shape={tuple(y.shape)}"
        )
    generator = torch.Generator().manual_seed(seed)
    y_cpu = y.detach().cpu()
    test_parts = []
    for cls in torch.unique(y_cpu).tolist():
        members = torch.nonzero(y_cpu == cls).flatten()
        # Round half up so a class of 5 with fraction 0.5 gives 3 test samples on every
        # platform (Python's round() would give 2, banker's rounding).
        n_test = int(members.numel() * test_fraction + 0.5)
        chosen = members[torch.randperm(members.numel(), generator=generator)[:n_test]]
        test_parts.append(chosen)
    test_mask = torch.zeros(y_cpu.numel(), dtype=torch.bool)
    test_mask[torch.cat(test_parts)] = True
    n_test = int(test_mask.sum())
    if n_test == 0 or n_test == y_cpu.numel():
        raise DataError(
            f"test_fraction={test_fraction} leaves an empty {'test' if n_test == 0 else 'train'} "
            f"split of {y_cpu.numel()} samples; choose a test_fraction that puts at least one "
            "sample on each side"
        )
    test_idx = torch.nonzero(test_mask).flatten()
    train_idx = torch.nonzero(~test_mask).flatten()
    return (
        (x[train_idx.to(x.device)], y[train_idx.to(y.device)]),
        (x[test_idx.to(x.device)], y[test_idx.to(y.device)]),
    )


def load_digits(
    split: str = "train", test_fraction: float = 0.2, seed: int = 0, image: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the embedded 8x8 digits as float32 images in [0, 1] and int64 labels.

    ``split`` is ``"train"``, ``"test"`` (a stratified split, see
    :func:`stratified_split`; the same ``test_fraction`` and ``seed`` always give the
    same, disjoint parts) or ``"all"`` (all 1,797 samples in file order). Pixels are
    divided by 16, their maximum. ``image=True`` shapes ``x`` as ``(N, 1, 8, 8)``,
    ``image=False`` as ``(N, 64)``.

    >>> x_train, y_train = load_digits("train")
    >>> x_test, y_test = load_digits("test", image=False)
    >>> len(y_train), len(y_test), tuple(x_test.shape[1:])
    (1438, 359, (64,))
    """
    check_choice("split", split, _SPLITS)
    x_u8, y_u8 = _digits_arrays()
    x = torch.from_numpy(x_u8.astype(np.float32)) / DIGITS_MAX_PIXEL
    y = torch.from_numpy(y_u8.astype(np.int64))
    if image:
        x = x.reshape(-1, 1, 8, 8)
    if split == "all":
        _check_fraction(test_fraction)
        _check_seed(seed)
        return x, y
    train, test = stratified_split(x, y, test_fraction=test_fraction, seed=seed)
    return train if split == "train" else test
