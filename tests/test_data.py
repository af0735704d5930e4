"""Tests for mixprec.train.data: the embedded digits, file loaders and seeded loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixprec.train.data import (
    DIGITS_NUM_CLASSES,
    DataError,
    DataFileNotFoundError,
    check_arrays,
    infer_num_classes,
    load_csv,
    load_digits,
    load_npz,
    make_loaders,
    stratified_split,
    train_test_loaders,
)

DIGIT_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


# --- embedded digits -------------------------------------------------------------


def test_digits_all_has_1797_samples_with_known_class_counts():
    x, y = load_digits("all")
    assert x.shape == (1797, 1, 8, 8)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.bincount().tolist() == DIGIT_COUNTS
    assert DIGITS_NUM_CLASSES == 10


def test_digits_pixels_are_sixteenths_in_unit_range():
    x, _ = load_digits("all", image=False)
    assert x.shape == (1797, 64)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    counts = x * 16
    assert torch.equal(counts, counts.round())


def test_digits_first_image_is_the_published_zero():
    x, y = load_digits("all")
    # The first two rows of the data set's first sample, a handwritten 0.
    assert (x[0, 0, :2] * 16).int().tolist() == [
        [0, 0, 5, 13, 9, 1, 0, 0],
        [0, 0, 13, 15, 10, 15, 5, 0],
    ]
    assert y[:10].tolist() == list(range(10))


def test_digits_split_is_stratified_and_partitions_the_data():
    x_all, y_all = load_digits("all")
    x_tr, y_tr = load_digits("train")
    x_te, y_te = load_digits("test")
    assert len(y_tr) == 1438 and len(y_te) == 359
    expected_test = [int(c * 0.2 + 0.5) for c in DIGIT_COUNTS]
    assert y_te.bincount().tolist() == expected_test
    assert (y_tr.bincount() + y_te.bincount()).tolist() == DIGIT_COUNTS
    # Integer pixel totals per class add up exactly: no sample lost or duplicated.
    for cls in range(10):
        total = (x_all[y_all == cls] * 16).round().long().sum()
        parts = (x_tr[y_tr == cls] * 16).round().long().sum() + (
            x_te[y_te == cls] * 16
        ).round().long().sum()
        assert int(total) == int(parts)


def test_digits_split_depends_on_seed_only():
    torch.manual_seed(1)
    a = load_digits("test", seed=7)
    torch.manual_seed(2)
    b = load_digits("test", seed=7)
    c = load_digits("test", seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_digits_test_fraction_changes_sizes():
    _, y_te = load_digits("test", test_fraction=0.5)
    assert len(y_te) == sum(int(c * 0.5 + 0.5) for c in DIGIT_COUNTS)


def test_digits_returns_fresh_tensors():
    x, _ = load_digits("all")
    x.zero_()
    x2, _ = load_digits("all")
    assert float(x2.max()) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"split": "valid"}, ValueError, "split must be one of"),
        ({"test_fraction": 0.0}, ValueError, "test_fraction must be a number in (0, 1), got 0.0"),
        ({"test_fraction": 1.5}, ValueError, "got 1.5"),
        ({"test_fraction": "0.2"}, TypeError, "test_fraction must be a finite number, got '0.2'"),
        ({"seed": 1.5}, TypeError, "seed must be a finite integer, got 1.5"),
    ],
)
def test_digits_rejects_bad_arguments(kwargs, exc, needle):
    with pytest.raises(exc) as info:
        load_digits(**kwargs)
    assert needle in str(info.value)


def test_stratified_split_is_disjoint_and_keeps_order():
    x = torch.arange(30).unsqueeze(1)
    y = torch.tensor([0] * 10 + [1] * 15 + [2] * 5)
    (x_tr, y_tr), (x_te, y_te) = stratified_split(x, y, test_fraction=0.2, seed=3)
    tr, te = set(x_tr.flatten().tolist()), set(x_te.flatten().tolist())
    assert tr.isdisjoint(te) and tr | te == set(range(30))
    assert y_te.bincount().tolist() == [2, 3, 1]
    assert x_tr.flatten().tolist() == sorted(tr)
    assert torch.equal(y[x_te.flatten()], y_te)


def test_stratified_split_refuses_empty_side():
    with pytest.raises(DataError, match="empty test split"):
        stratified_split(torch.zeros(3, 1), torch.tensor([0, 1, 2]), test_fraction=0.1)


# --- npz -------------------------------------------------------------------------


def test_load_npz_round_trip(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(
        p, x=np.arange(12, dtype=np.uint8).reshape(3, 4), y=np.array([2, 0, 1]), extra=np.ones(2)
    )
    x, y = load_npz(p)
    assert x.dtype == torch.float32 and x.shape == (3, 4)
    assert x[2].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert y.dtype == torch.int64 and y.tolist() == [2, 0, 1]


def test_load_npz_missing_file_is_file_not_found_and_data_error(tmp_path):
    p = tmp_path / "nope.npz"
    with pytest.raises(FileNotFoundError) as info:
        load_npz(p)
    assert isinstance(info.value, DataError) and isinstance(info.value, DataFileNotFoundError)
    assert "nope.npz" in str(info.value)


def test_load_npz_names_missing_and_found_arrays(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.ones((2, 2)), labels=np.zeros(2))
    with pytest.raises(DataError) as info:
        load_npz(p)
    msg = str(info.value)
    assert "missing array(s) 'y'" in msg and "'labels'" in msg and "'x'" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("y", "needle"),
    [
        (np.array([0, -1, 2]), "labels must be >= 0, got -1 (at sample 1)"),
        (np.array([0, 1.5, 2]), "labels must be whole numbers, got 1.5 (at sample 1)"),
        (np.array([0, 1]), "x has 3 samples but y has 2 labels"),
        (np.array(["a", "b", "c"]), "labels y must be integer class indices"),
    ],
)
def test_load_npz_rejects_bad_labels(tmp_path, y, needle):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.ones((3, 2)), y=y)
    with pytest.raises(DataError) as info:
        load_npz(p)
    assert needle in str(info.value)


def test_load_npz_label_out_of_range_for_num_classes(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.ones((3, 2)), y=np.array([0, 3, 1]))
    assert load_npz(p)[1].tolist() == [0, 3, 1]
    with pytest.raises(
        DataError, match=r"label 3 \(at sample 1\) is out of range for num_classes=3"
    ):
        load_npz(p, num_classes=3)


def test_load_npz_accepts_one_hot_and_rejects_soft_labels(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.ones((3, 2)), y=np.eye(4, dtype=np.float32)[[3, 0, 2]])
    assert load_npz(p)[1].tolist() == [3, 0, 2]
    np.savez(p, x=np.ones((2, 2)), y=np.array([[0.5, 0.5], [1.0, 0.0]]))
    with pytest.raises(DataError, match="must be one-hot"):
        load_npz(p)


def test_load_npz_rejects_non_finite_features_and_bad_files(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.array([[1.0], [np.nan]]), y=np.array([0, 1]))
    with pytest.raises(DataError, match=r"NaN or infinity \(first at sample 1\)"):
        load_npz(p)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip archive")
    with pytest.raises(DataError, match="not a readable .npz archive"):
        load_npz(junk)
    single = tmp_path / "single.npz"
    with single.open("wb") as f:
        np.save(f, np.ones(3))
    with pytest.raises(DataError, match="single array"):
        load_npz(single)
    objects = tmp_path / "obj.npz"
    np.savez(objects, x=np.array([[1], [2]], dtype=object), y=np.array([0, 1]))
    with pytest.raises(DataError, match="without pickle"):
        load_npz(objects)
    with pytest.raises(DataError, match="is not a file"):
        load_npz(tmp_path)


# --- csv -------------------------------------------------------------------------


def test_load_csv_without_header_uses_last_column(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("0.5,1,2\n3,4,0\n\n")
    x, y = load_csv(p)
    assert x.tolist() == [[0.5, 1.0], [3.0, 4.0]] and y.tolist() == [2, 0]


def test_load_csv_header_label_column_anywhere(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("a,Label,b\n1,2,3\n4,0,5\n")
    x, y = load_csv(p)
    assert x.tolist() == [[1.0, 3.0], [4.0, 5.0]] and y.tolist() == [2, 0]


def test_load_csv_header_without_label_uses_last_column(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("a,b,target\n1,2,3\n4,5,1\n")
    x, y = load_csv(p)
    assert x.tolist() == [[1.0, 2.0], [4.0, 5.0]] and y.tolist() == [3, 1]


def test_load_csv_round_trips_the_digits(tmp_path):
    x, y = load_digits("all", image=False)
    counts = (x * 16).round().long()
    p = tmp_path / "digits.csv"
    header = ",".join(f"p{i}" for i in range(64)) + ",label"
    rows = [
        ",".join(map(str, r)) + f",{c}" for r, c in zip(counts.tolist(), y.tolist(), strict=True)
    ]
    p.write_text(header + "\n" + "\n".join(rows) + "\n")
    x2, y2 = load_csv(p, num_classes=10)
    assert torch.equal(x2, counts.float()) and torch.equal(y2, y)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "the file is empty"),
        ("a,label\n", "has a header but no data rows"),
        ("1,2,0\n3,4\n", "line 2 has 2 fields, expected 3"),
        ("a,b,label\n1,x,0\n", "line 2, column 'b': 'x' is not a number"),
        ("1,2,0.5\n", "labels must be whole numbers, got 0.5 (at sample 0)"),
        ("1,2,-3\n", "labels must be >= 0, got -3 (at sample 0)"),
        ("1\n2\n", "needs at least 2 columns"),
    ],
)
def test_load_csv_rejects_malformed_files(tmp_path, text, needle):
    p = tmp_path / "d.csv"
    p.write_text(text)
    with pytest.raises(DataError) as info:
        load_csv(p)
    assert needle in str(info.value)


def test_load_csv_missing_file_and_bad_path_type(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="csv file not found"):
        load_csv(tmp_path / "missing.csv")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        load_csv(3)


# --- validation helpers ------------------------------------------------------------


def test_check_arrays_squeezes_column_labels_and_rejects_1d_features():
    x, y = check_arrays(np.ones((2, 3)), np.array([[1.0], [0.0]]))
    assert y.tolist() == [1, 0] and y.dtype == torch.int64
    with pytest.raises(DataError, match=r"shape \(N, features...\), got shape \(2,\)"):
        check_arrays(np.ones(2), np.array([0, 1]))


def test_infer_num_classes():
    assert infer_num_classes(torch.tensor([0, 4, 2])) == 5
    assert infer_num_classes(np.eye(3)) == 3
    assert infer_num_classes(load_digits("all")[1]) == 10
    with pytest.raises(DataError, match="empty"):
        infer_num_classes(torch.tensor([], dtype=torch.long))
    with pytest.raises(DataError, match="non-negative whole numbers"):
        infer_num_classes(torch.tensor([-1, 2]))


# --- loaders ---------------------------------------------------------------------


def _order(loader):
    return torch.cat([xb.flatten() for xb, _ in loader]).tolist()


def test_make_loaders_order_is_reproducible_and_seeded():
    x, y = torch.arange(50.0).unsqueeze(1), torch.zeros(50, dtype=torch.long)
    torch.manual_seed(0)
    a = _order(make_loaders(x, y, 8, seed=1))
    torch.manual_seed(99)
    b = _order(make_loaders(x, y, 8, seed=1))
    c = _order(make_loaders(x, y, 8, seed=2))
    assert a == b and a != c
    assert sorted(a) == list(range(50))
    assert _order(make_loaders(x, y, 8, shuffle=False)) == list(range(50))


def test_make_loaders_epochs_differ_but_replay_from_generator_state():
    x, y = torch.arange(20.0).unsqueeze(1), torch.zeros(20, dtype=torch.long)
    loader = make_loaders(x, y, 5, seed=0)
    first = _order(loader)
    saved = loader.generator.get_state()
    second = _order(loader)
    assert first != second
    loader.generator.set_state(saved)
    assert _order(loader) == second


def test_make_loaders_batches_and_drop_last():
    x, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.long)
    assert [len(yb) for _, yb in make_loaders(x, y, 4)] == [4, 4, 2]
    assert [len(yb) for _, yb in make_loaders(x, y, 4, drop_last=True)] == [4, 4]


@pytest.mark.parametrize(
    ("args", "exc", "needle"),
    [
        ((torch.zeros(4, 2), torch.zeros(3), 2), ValueError, "same number of samples"),
        ((np.zeros((4, 2)), torch.zeros(4), 2), TypeError, "x must be a torch.Tensor, got ndarray"),
        (
            (torch.zeros(4, 2), torch.zeros(4), 0),
            ValueError,
            "batch_size must be an integer >= 1, got 0",
        ),
        (
            (torch.zeros(4, 2), torch.zeros(4), 2.0),
            TypeError,
            "batch_size must be an integer >= 1, got 2.0",
        ),
    ],
)
def test_make_loaders_rejects_bad_input(args, exc, needle):
    with pytest.raises(exc) as info:
        make_loaders(*args)
    assert needle in str(info.value)


def test_train_test_loaders_on_digits():
    train, test = train_test_loaders(batch_size=100, eval_batch_size=500, seed=0, image=False)
    assert len(train.dataset) == 1438 and len(test.dataset) == 359
    assert len(train) == 15 and len(test) == 1
    xb, yb = next(iter(test))
    x_te, y_te = load_digits("test", seed=0, image=False)
    assert torch.equal(xb, x_te) and torch.equal(yb, y_te)


def test_train_test_loaders_on_own_data_and_argument_checks():
    x, y = torch.arange(40.0).unsqueeze(1), torch.tensor([0, 1] * 20)
    train, test = train_test_loaders(x, y, batch_size=4, test_fraction=0.25)
    assert len(train.dataset) == 30 and len(test.dataset) == 10
    with pytest.raises(ValueError, match="pass both x and y"):
        train_test_loaders(x, batch_size=4)
    with pytest.raises(ValueError, match="eval_batch_size must be an integer >= 1, got 0"):
        train_test_loaders(batch_size=4, eval_batch_size=0)
