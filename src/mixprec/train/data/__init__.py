"""Data for training front ends: the embedded digits, file loaders and seeded loaders.

- :func:`load_digits`: 1,797 8x8 handwritten digits shipped with the package
  (UCI, CC BY 4.0; credit in ``LICENSE-digits.txt``), split train/test by a
  seeded stratified split.
- :func:`load_npz`, :func:`load_csv`: a user's own data, validated; every
  problem raises :class:`DataError` (a ``ValueError``) with a one-line message.
- :func:`make_loaders`, :func:`train_test_loaders`, :func:`train_val_test_loaders`:
  ``DataLoader`` objects whose shuffling is reproducible from a seed (the last also
  carves a validation part out of the training part, apart from the test set).

>>> from mixprec.train.data import train_test_loaders
>>> train, test = train_test_loaders(batch_size=32, seed=0)
>>> x, y = next(iter(train))
>>> tuple(x.shape), y.dtype
((32, 1, 8, 8), torch.int64)
"""

from ._digits import DIGITS_MAX_PIXEL, DIGITS_NUM_CLASSES, load_digits, stratified_split
from ._files import LABEL_COLUMN, load_csv, load_npz
from ._loaders import VAL_FRACTION, make_loaders, train_test_loaders, train_val_test_loaders
from ._validate import DataError, DataFileNotFoundError, check_arrays, infer_num_classes

__all__ = [
    "DIGITS_MAX_PIXEL",
    "DIGITS_NUM_CLASSES",
    "LABEL_COLUMN",
    "DataError",
    "DataFileNotFoundError",
    "check_arrays",
    "infer_num_classes",
    "load_csv",
    "load_digits",
    "load_npz",
    "make_loaders",
    "stratified_split",
    "train_test_loaders",
    "train_val_test_loaders",
    "VAL_FRACTION",
]
