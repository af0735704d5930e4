"""Tests for mixprec.train.metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.train.metrics import METRIC_NAMES, Accuracy, Loss, Metric, TopKAccuracy, build_metric

# Three samples, four classes. Ranks of each row's logits, largest first:
# row 0: 1, 3, 0, 2   row 1: 0, 2, 1, 3   row 2: 3, 2, 1, 0
LOGITS = torch.tensor(
    [
        [0.5, 3.0, 0.1, 1.0],
        [4.0, 0.0, 1.0, -1.0],
        [0.0, 1.0, 2.0, 3.0],
    ]
)
TARGETS = torch.tensor([1, 2, 0])  # top-1 hits: row 0 only; top-2: rows 0, 1; top-4: all


def test_accuracy_hand_computed_over_batches():
    acc = Accuracy()
    acc.update(LOGITS, TARGETS)
    assert acc.compute() == pytest.approx(1 / 3)
    acc.update(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([1]))
    assert acc.compute() == pytest.approx(2 / 4)
    assert acc.name == "accuracy" and acc.count == 4


@pytest.mark.parametrize(("k", "expected"), [(1, 1 / 3), (2, 2 / 3), (3, 2 / 3), (4, 1.0)])
def test_top_k_accuracy_hand_computed(k, expected):
    m = TopKAccuracy(k=k)
    m.update(LOGITS, TARGETS)
    assert m.compute() == pytest.approx(expected)
    assert m.name == f"top{k}_accuracy"


def test_targets_as_one_hot_float_indices_or_column():
    one_hot = F.one_hot(TARGETS, 4).float()
    for targets in (one_hot, TARGETS.float(), TARGETS.unsqueeze(1), TARGETS.float().unsqueeze(1)):
        acc, top2 = Accuracy(), TopKAccuracy(k=2)
        acc.update(LOGITS, targets)
        top2.update(LOGITS, targets)
        assert acc.compute() == pytest.approx(1 / 3)
        assert top2.compute() == pytest.approx(2 / 3)


def test_accuracy_on_spatial_logits_counts_every_position():
    logits = torch.zeros(2, 3, 2)
    logits[0, 1, :] = 1.0  # sample 0 predicts class 1 at both positions
    logits[1, 2, 0] = 1.0  # sample 1 predicts class 2, then class 0 (all zero -> argmax 0)
    acc = Accuracy()
    acc.update(logits, torch.tensor([[1, 0], [2, 0]]))
    assert acc.compute() == pytest.approx(3 / 4)


def test_reset_and_compute_before_update():
    acc = Accuracy()
    with pytest.raises(RuntimeError, match="has no samples; call update"):
        acc.compute()
    acc.update(LOGITS, TARGETS)
    acc.reset()
    with pytest.raises(RuntimeError, match="'accuracy' has no samples"):
        acc.compute()
    acc.update(LOGITS[:1], TARGETS[:1])
    assert acc.compute() == 1.0


def test_shape_and_type_errors_name_what_was_received():
    with pytest.raises(
        ValueError, match=r"targets of shape \(2,\) do not match logits of shape \(3, 4\)"
    ):
        Accuracy().update(LOGITS, TARGETS[:2])
    with pytest.raises(ValueError, match=r"logits must have shape \(N, C, ...\), got shape \(4,\)"):
        Accuracy().update(LOGITS[0], TARGETS[:1])
    with pytest.raises(TypeError, match=r"targets must be a torch.Tensor, got list \[1, 2, 0\]"):
        Accuracy().update(LOGITS, [1, 2, 0])
    with pytest.raises(ValueError, match=r"k=5 exceeds the number of classes \(4\)"):
        TopKAccuracy(k=5).update(LOGITS, TARGETS)
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0; pass e.g. k=5"):
        TopKAccuracy(k=0)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        Accuracy(name="")


def test_loss_is_sample_weighted_mean_of_batch_means():
    m = Loss()
    m.update(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), loss=torch.tensor(2.0))
    m.update(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), loss=6.0)
    assert m.compute() == pytest.approx((3 * 2.0 + 1 * 6.0) / 4)
    assert m.name == "loss"


def test_loss_without_loss_argument_is_cross_entropy():
    a, b = LOGITS[:2], LOGITS[2:]
    m = Loss()
    m.update(a, TARGETS[:2])
    m.update(b, F.one_hot(TARGETS[2:], 4).float())
    assert m.compute() == pytest.approx(float(F.cross_entropy(LOGITS, TARGETS)), rel=1e-6)
    # By hand for one row: log-sum-exp minus the target logit.
    one = Loss()
    one.update(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([0]))
    assert one.compute() == pytest.approx(math.log(4.0))


def test_loss_rejects_unreduced_or_odd_losses():
    with pytest.raises(
        ValueError, match=r"got a tensor of shape \(3,\); reduce it with loss.mean\(\)"
    ):
        Loss().update(LOGITS, TARGETS, loss=torch.ones(3))
    with pytest.raises(TypeError, match="loss must be a tensor, a float or None, got str"):
        Loss().update(LOGITS, TARGETS, loss="1.0")


def test_update_never_reads_values_back_to_the_host(monkeypatch):
    def no_sync(self):
        raise AssertionError("update() synchronised with the device via .item()")

    metrics = [Accuracy(), TopKAccuracy(k=2), Loss()]
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    for _ in range(3):
        for m in metrics:
            m.update(LOGITS, TARGETS, loss=torch.tensor(0.5))
    Loss().update(LOGITS, TARGETS)
    monkeypatch.undo()
    assert [m.compute() for m in metrics] == pytest.approx([1 / 3, 2 / 3, 0.5])


def test_low_precision_logits():
    acc, loss = Accuracy(), Loss()
    logits = LOGITS.to(torch.bfloat16)
    acc.update(logits, TARGETS)
    loss.update(logits, TARGETS)
    assert acc.compute() == pytest.approx(1 / 3)
    assert loss.compute() == pytest.approx(
        float(F.cross_entropy(logits.float(), TARGETS)), rel=1e-6
    )


def test_metric_is_abstract_and_build_metric():
    with pytest.raises(TypeError, match="abstract"):
        Metric()
    assert [type(build_metric(n)) for n in METRIC_NAMES] == [Accuracy, Loss, TopKAccuracy]
    assert build_metric("ACC").name == "accuracy"
    assert build_metric("top3_accuracy").k == 3
    with pytest.raises(ValueError, match="unknown metric name 'f1'; choose accuracy, loss or topK"):
        build_metric("f1")
