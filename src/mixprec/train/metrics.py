"""Streaming classification metrics: accuracy, top-k accuracy and mean loss.

A metric is fed one batch at a time and reports over everything seen since the
last ``reset()``::

    reset()                                  # totals := nothing
    update(logits, targets, loss=None)       # totals += this batch (device tensors)
    compute() -> float                       # one host sync: read the totals

``update`` adds to tensors on the logits' device and never calls ``.item()``, so an
evaluation loop on a GPU does not stall once per batch; ``compute`` syncs once.
Targets may be class indices ``(N,)`` (integer or integral float), ``(N, 1)``, or
one-hot / probability rows ``(N, C)`` shaped like the logits, which are reduced
with ``argmax`` (the form MindSpore's ``SoftmaxCrossEntropyWithLogits`` takes).

>>> import torch
>>> acc = Accuracy()
>>> acc.update(torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 0]))
>>> acc.update(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 1.0]]))
>>> acc.name, acc.compute()
('accuracy', 0.6666666666666666)
"""

from __future__ import annotations

import abc
import re

import torch
import torch.nn.functional as F

from mixprec._checks import check_instance, check_number

__all__ = ["Metric", "Accuracy", "TopKAccuracy", "Loss", "build_metric", "METRIC_NAMES"]


def _class_indices(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Return targets as int64 class indices shaped like ``logits`` without dim 1."""
    check_instance("logits", logits, torch.Tensor, "a torch.Tensor")
    check_instance(
        "targets", targets, torch.Tensor, "a torch.Tensor", hint="convert with torch.as_tensor"
    )
    if logits.ndim < 2:
        raise ValueError(
            f"logits must have shape (N, C, ...), got shape {tuple(logits.shape)}; for a "
            "single sample add a batch axis with logits.unsqueeze(0)"
        )
    expected = logits.shape[:1] + logits.shape[2:]
    if targets.shape == logits.shape and logits.shape[1] > 1:
        return targets.argmax(dim=1)
    if targets.ndim == logits.ndim and targets.shape[1] == 1:
        targets = targets.squeeze(1)
    if targets.shape != expected:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match logits of shape "
            f"{tuple(logits.shape)}; pass class indices of shape {tuple(expected)} or "
            f"one-hot rows of shape {tuple(logits.shape)}"
        )
    if targets.is_floating_point():
        # Class indices stored as floats, e.g. the tutorial's float32 label column.
        return targets.round().long()
    return targets.long()


class Metric(abc.ABC):
    """Base class of streaming metrics: ``reset``, ``update``, ``compute``, ``name``.

    Running sums that depend on tensor values stay on the logits' device
    (``_add``/``_total``); sample counts come from shapes, so they are plain ints.

    >>> class MeanMax(Metric):
    ...     def update(self, logits, targets, loss=None):
    ...         self._add("sum", logits.detach().amax(dim=1).sum())
    ...         self.count += logits.shape[0]
    ...     def compute(self):
    ...         return self._total("sum").item() / self.count
    >>> m = MeanMax(name="mean_max")
    >>> m.update(torch.tensor([[1.0, 2.0], [4.0, 3.0]]), torch.tensor([0, 0]))
    >>> m.compute()
    3.0
    """

    default_name = "metric"

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            check_instance("name", name, str, "a non-empty str or None")
            if not name:
                raise ValueError("name must be a non-empty str or None, got ''")
        self._name = name if name is not None else self.default_name
        self.reset()

    @property
    def name(self) -> str:
        """The key this metric's value is reported under, e.g. ``"accuracy"``."""
        return self._name

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self._totals: dict[str, torch.Tensor] = {}
        self.count = 0

    @abc.abstractmethod
    def update(
        self, logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor | float | None = None
    ) -> None:
        """Add one batch; never syncs with the device."""

    @abc.abstractmethod
    def compute(self) -> float:
        """Return the metric over all batches since ``reset``; syncs with the device once."""

    def _add(self, key: str, value: torch.Tensor) -> None:
        current = self._totals.get(key)
        self._totals[key] = value if current is None else current + value.to(current.device)

    def _check_samples(self) -> None:
        if self.count == 0:
            raise RuntimeError(
                f"{type(self).__name__} {self.name!r} has no samples; call update() with at "
                "least one batch before compute()"
            )

    def _total(self, key: str) -> torch.Tensor:
        self._check_samples()
        return self._totals[key]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class TopKAccuracy(Metric):
    """Fraction of samples whose target is among the ``k`` largest logits.

    Ties are broken by ``torch.topk``. ``k`` must not exceed the number of classes.

    >>> m = TopKAccuracy(k=2)
    >>> m.update(torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]]), torch.tensor([1, 2]))
    >>> m.name, m.compute()
    ('top2_accuracy', 0.5)
    """

    def __init__(self, k: int = 5, name: str | None = None) -> None:
        self.k = check_number("k", k, integer=True, minimum=1, hint="pass e.g. k=5")
        super().__init__(name if name is not None else f"top{self.k}_accuracy")

    def _hits(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.k > logits.shape[1]:
            raise ValueError(
                f"k={self.k} exceeds the number of classes ({logits.shape[1]}) in logits of "
                f"shape {tuple(logits.shape)}; use k <= {logits.shape[1]}"
            )
        top = logits.detach().topk(self.k, dim=1).indices
        return (top == indices.unsqueeze(1)).any(dim=1)

    def update(
        self, logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor | float | None = None
    ) -> None:
        """Count the samples of this batch whose target is a top-``k`` logit."""
        indices = _class_indices(logits, targets)
        hits = self._hits(logits, indices)
        self._add("correct", hits.sum())
        self.count += indices.numel()

    def compute(self) -> float:
        """Return hits / samples."""
        return self._total("correct").item() / self.count


class Accuracy(TopKAccuracy):
    """Fraction of samples whose largest logit is the target class.

    >>> m = Accuracy()
    >>> m.update(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    >>> m.compute()
    0.5
    """

    def __init__(self, name: str | None = None) -> None:
        super().__init__(k=1, name=name if name is not None else "accuracy")

    def _hits(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # argmax gives the same answer as topk(1) and is cheaper on every device.
        return logits.detach().argmax(dim=1) == indices


class Loss(Metric):
    """Sample-weighted mean of per-batch mean losses.

    ``update`` takes the batch's mean loss (tensor or float) and weights it by the
    batch size, so a short last batch counts for what it holds. If ``loss`` is
    ``None``, the mean softmax cross-entropy of ``logits`` (in float32) against
    ``targets`` is used.

    >>> m = Loss()
    >>> m.update(torch.zeros(3, 2), torch.tensor([0, 1, 0]), loss=torch.tensor(1.0))
    >>> m.update(torch.zeros(1, 2), torch.tensor([1]), loss=5.0)
    >>> m.compute()
    2.0
    """

    default_name = "loss"

    def reset(self) -> None:
        """Forget every batch seen so far."""
        super().reset()
        # Losses passed as Python floats are already on the host: keep them there
        # rather than paying a host-to-device copy per batch.
        self._host_sum = 0.0

    def update(
        self, logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor | float | None = None
    ) -> None:
        """Add ``loss`` (or the cross-entropy of this batch) weighted by batch size."""
        if not isinstance(logits, torch.Tensor) or logits.ndim < 1:
            raise TypeError(
                f"logits must be a tensor with a batch axis, got {type(logits).__name__}"
            )
        n = logits.shape[0]
        if loss is None:
            logits32 = logits.detach().float()
            if isinstance(targets, torch.Tensor) and targets.shape == logits.shape:
                value = F.cross_entropy(logits32, targets.float())
            else:
                value = F.cross_entropy(logits32, _class_indices(logits, targets))
        elif isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"loss must be the batch's mean (one value), got a tensor of shape "
                    f"{tuple(loss.shape)}; reduce it with loss.mean()"
                )
            value = loss.detach().reshape(())
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self._host_sum += float(loss) * n
            self.count += n
            return
        else:
            raise TypeError(
                f"loss must be a tensor, a float or None, got {type(loss).__name__} {loss!r}"
            )
        self._add("sum", value.float() * n)
        self.count += n

    def compute(self) -> float:
        """Return the sample-weighted mean loss."""
        self._check_samples()
        device_sum = self._totals["sum"].item() if "sum" in self._totals else 0.0
        return (device_sum + self._host_sum) / self.count


#: Metric names :func:`build_metric` understands (``topK`` takes any K, e.g. ``top3``).
METRIC_NAMES: tuple[str, ...] = ("accuracy", "loss", "top5")

_TOPK = re.compile(r"top(\d+)(_accuracy)?")


def build_metric(name: str) -> Metric:
    """Build a metric from a short name: ``accuracy``/``acc``, ``loss``, ``topK``.

    >>> [m.name for m in map(build_metric, ["acc", "loss", "top3"])]
    ['accuracy', 'loss', 'top3_accuracy']
    """
    check_instance("name", name, str, "a str such as 'accuracy'")
    key = name.strip().lower()
    if key in ("accuracy", "acc"):
        return Accuracy()
    if key == "loss":
        return Loss()
    match = _TOPK.fullmatch(key)
    if match:
        return TopKAccuracy(k=int(match.group(1)))
    raise ValueError(f"unknown metric name {name!r}; choose accuracy, loss or topK (e.g. top5)")
