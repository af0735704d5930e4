"""``Model``: train, evaluate and predict with any amp level, in a few lines.

The PyTorch counterpart of MindSpore's ``Model(network, loss_fn, optimizer,
metrics, amp_level, loss_scale_manager).train(...)``. One training step reads
top to bottom::

    x = x.to(device)                      # the amp level casts floating inputs on entry
    out = network(x)                      # low-precision compute where the level says
    loss = loss_fn(out.float(), y)        # the loss is always computed in float32
    optimizer.scale_loss(loss).backward() # scaled backward
    optimizer.step()                      # unscale, check, skip or apply, update the scale
    optimizer.zero_grad()

>>> import torch
>>> from torch.utils.data import DataLoader, TensorDataset
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
>>> net = torch.nn.Linear(4, 2)
>>> model = Model(net, torch.nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.5),
...               metrics=["accuracy"], amp_level="O1", dtype=torch.bfloat16)
>>> history = model.train(5, DataLoader(TensorDataset(x, y), batch_size=16))
>>> model.eval(DataLoader(TensorDataset(x, y), batch_size=64))["accuracy"] > 0.9
True
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mixprec.callbacks import Callback, CallbackList, History, RunState
from mixprec.loss_scale import DynamicLossScale
from mixprec.managers import resolve_loss_scale
from mixprec.metrics import build_metric
from mixprec.optim import LossScaleOptimizer

__all__ = ["Model", "AMP_LEVELS", "resolve_dtype", "resolve_device", "default_low_precision_dtype"]

AMP_LEVELS = ("O0", "O1", "O2", "O3", "auto", "rewrite")
CHECKPOINT_FORMAT = "mixprec-checkpoint-1"
_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: Any) -> torch.device:
    """``None`` picks CUDA when available, else the CPU; strings and devices pass through."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'"
        ) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} was asked for but CUDA is not available here; use 'cpu'"
        )
    return resolved


def default_low_precision_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA (tensor cores everywhere, loss scaling handles the range);
    bfloat16 on CPUs, which have fast bfloat16 units far more often than float16 ones."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """The low-precision dtype: ``None`` (device default), a name, or a torch dtype."""
    if dtype is None:
        return default_low_precision_dtype(device)
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    raise ValueError(
        f"dtype={dtype!r} is not a low-precision dtype: use 'float16', 'bfloat16', "
        "torch.float16 or torch.bfloat16 (amp_level='O0' keeps float32)"
    )


def _build_metrics(metrics: Any) -> dict[str, Any]:
    if metrics is None:
        metrics = ["accuracy", "loss"]
    if isinstance(metrics, Mapping):
        return dict(metrics)
    if isinstance(metrics, str) or not isinstance(metrics, Iterable):
        raise TypeError(
            f"metrics must be a dict of name -> metric, or a list of names/metrics, got {metrics!r}"
        )
    built = [build_metric(m) if isinstance(m, str) else m for m in metrics]
    return {getattr(m, "name", type(m).__name__.lower()): m for m in built}


def _loader_generator(dataset: Any) -> torch.Generator | None:
    """The generator that decides a DataLoader's shuffling (to checkpoint it)."""
    return getattr(dataset, "generator", None)


def _example_batch(dataset: Any) -> torch.Tensor:
    """Two example inputs, without advancing a DataLoader's shuffling generator."""
    inner = getattr(dataset, "dataset", None)
    if inner is not None and hasattr(inner, "__getitem__") and len(inner) >= 2:
        return torch.stack([torch.as_tensor(inner[0][0]), torch.as_tensor(inner[1][0])])
    x, _ = next(iter(dataset))
    return x


class Model:
    """Wrap a network with its loss, optimizer, metrics and amp level.

    Args:
        network: the ``nn.Module`` to train (written in float32).
        loss_fn: ``loss_fn(logits, targets)``; default ``nn.CrossEntropyLoss()`` (which also
            takes one-hot / probability targets). Always evaluated in float32.
        optimizer: any ``torch.optim.Optimizer`` (wrapped in a ``LossScaleOptimizer`` for the
            level), or a ``LossScaleOptimizer``; ``None`` for evaluation only.
        metrics: dict ``name -> metric``, or a list of names (``"accuracy"``, ``"loss"``,
            ``"top5"``) or metric objects; default accuracy and loss.
        amp_level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"auto"`` (see ``mixprec.amp``), or
            ``"rewrite"`` (the graph rewrite, built at the first batch).
        loss_scale_manager: a ``FixedLossScaleManager``/``DynamicLossScaleManager``, a
            ``LossScale``, ``"dynamic"``, a number, or ``None`` for the level's default.
        dtype: the low-precision dtype (default: float16 on CUDA, bfloat16 on CPU).
        device: default CUDA if available, else CPU.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        loss_fn: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Any = None,
        amp_level: str = "O0",
        loss_scale_manager: Any = None,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        if not isinstance(network, torch.nn.Module):
            raise TypeError(f"network must be a torch.nn.Module, got {type(network).__name__}")
        if amp_level not in AMP_LEVELS:
            raise ValueError(f"amp_level={amp_level!r} is not one of {list(AMP_LEVELS)}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(logits, targets), got {loss_fn!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.amp_level = amp_level
        self.loss_fn = loss_fn if loss_fn is not None else torch.nn.CrossEntropyLoss()
        self.metrics = _build_metrics(metrics)
        if loss_scale_manager is None:
            self._loss_scale, self._drop_overflow = None, True
        else:
            self._loss_scale, self._drop_overflow = resolve_loss_scale(loss_scale_manager)
        self.network = network.to(self.device)
        self.optimizer: LossScaleOptimizer | None = None
        self._raw_optimizer = optimizer
        self.history: History | None = None
        self._generator: torch.Generator | None = None
        self._ready = False
        if amp_level != "rewrite":
            self._prepare(None)

    # -- building the mixed-precision network ------------------------------------------

    def _prepare(self, dataset: Any) -> None:
        """Apply the amp level (or the graph rewrite) and wrap the optimizer, once."""
        if self._ready:
            return
        optimizer = self._raw_optimizer
        if isinstance(optimizer, LossScaleOptimizer) and self.amp_level == "O0":
            self.optimizer = optimizer
        elif self.amp_level == "rewrite":
            from mixprec.rewrite import rewrite

            example = _example_batch(dataset).to(self.device)
            self.network = rewrite(self.network, (example,), dtype=self.dtype)
            if optimizer is not None:
                self.optimizer = (
                    optimizer
                    if isinstance(optimizer, LossScaleOptimizer)
                    else LossScaleOptimizer(
                        optimizer, loss_scale=self._loss_scale or DynamicLossScale()
                    )
                )
        else:
            from mixprec import amp

            self.network, self.optimizer = amp.initialize(
                self.network,
                optimizer,
                level=self.amp_level,
                dtype=self.dtype,
                loss_scale=self._loss_scale,
            )
        if self.optimizer is not None and not self._drop_overflow:
            # FixedLossScaleManager(drop_overflow_update=False): apply even on overflow.
            self.optimizer.skip_nonfinite = False
        self._ready = True

    # -- one step ----------------------------------------------------------------------

    def _to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(batch, Sequence) and len(batch) == 2):
            raise ValueError(
                f"each batch must be an (inputs, targets) pair, got {type(batch).__name__}"
            )
        x, y = batch
        return torch.as_tensor(x).to(self.device), torch.as_tensor(y).to(self.device)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, float32 loss, scaled backward, step (or skip). Returns (loss, logits)."""
        opt = self.optimizer
        out = self.network(x)
        loss = self.loss_fn(out.float(), y)
        self.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), out.detach()

    def current_loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (reading it syncs)."""
        return float(self.optimizer.loss_scale)

    def backward(self, loss: torch.Tensor) -> None:
        """The scaled backward pass (a subclass may scale differently)."""
        self.optimizer.scale_loss(loss).backward()

    # -- the loops ---------------------------------------------------------------------

    def train(
        self,
        epochs: int,
        train_dataset: Iterable,
        callbacks: Sequence[Callback] | None = None,
        resume: str | Path | None = None,
        eval_dataset: Iterable | None = None,
    ) -> History:
        """Train for ``epochs`` epochs (in total, counting a resumed checkpoint's).

        ``callbacks`` get a :class:`~mixprec.callbacks.RunState` at each hook; a
        ``History`` is always kept and returned. ``resume`` names a checkpoint written by
        ``ModelCheckpoint``/:meth:`save_checkpoint`: model, optimizer (with loss-scale state,
        master weights, EMA), counters, callbacks and random-number state are restored, so
        the run continues exactly as if it had not stopped. With ``eval_dataset``, each
        epoch's metrics include ``val_<name>``. One host sync per step reads the loss and
        the skip flag for the callbacks.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        self._prepare(train_dataset)
        if self.optimizer is None:
            raise ValueError("this Model has no optimizer: pass optimizer=... to train it")
        callbacks = list(callbacks or [])
        self.history = next((c for c in callbacks if isinstance(c, History)), None)
        if self.history is None:
            self.history = History()
            callbacks.append(self.history)
        cbs = CallbackList(callbacks)
        self._generator = _loader_generator(train_dataset)
        state = RunState(
            epochs=epochs,
            steps_per_epoch=len(train_dataset) if hasattr(train_dataset, "__len__") else None,
            model=self.network,
            optimizer=self.optimizer,
            save_checkpoint=lambda path: self.save_checkpoint(path, state, cbs),
        )
        if resume is not None:
            self._load_checkpoint(resume, state, cbs)
        cbs.on_train_begin(state)
        for epoch in range(state.epoch + 1, epochs + 1):
            state.epoch, state.step_in_epoch = epoch, 0
            self.network.train()
            for m in self.metrics.values():
                m.reset()
            cbs.on_epoch_begin(state)
            for batch in train_dataset:
                t0 = time.perf_counter()
                x, y = self._to_device(batch)
                loss, out = self.train_step(x, y)
                for m in self.metrics.values():
                    m.update(out, y, loss=loss)
                state.step += 1
                state.step_in_epoch += 1
                state.loss = float(loss)  # the step's one host sync
                state.loss_scale = self.current_loss_scale()
                state.skipped = bool(self.optimizer.last_step_skipped)
                state.skipped_steps = int(self.optimizer.skipped_steps)
                state.samples_per_s = x.shape[0] / max(time.perf_counter() - t0, 1e-9)
                cbs.on_step_end(state)
            state.metrics = {name: m.compute() for name, m in self.metrics.items()}
            if eval_dataset is not None:
                state.metrics.update({f"val_{k}": v for k, v in self.eval(eval_dataset).items()})
            cbs.on_epoch_end(state)
            if state.stop_training:
                break
        cbs.on_train_end(state)
        return self.history

    fit = train

    @torch.no_grad()
    def eval(self, dataset: Iterable) -> dict[str, float]:
        """Metrics over ``dataset`` in eval mode (no dropout, BatchNorm running stats)."""
        self._prepare(dataset)
        was_training = self.network.training
        self.network.eval()
        metrics = copy.deepcopy(self.metrics)  # leave the training metrics alone
        for m in metrics.values():
            m.reset()
        try:
            for batch in dataset:
                x, y = self._to_device(batch)
                out = self.network(x).float()
                loss = self.loss_fn(out, y)
                for m in metrics.values():
                    m.update(out, y, loss=loss)
        finally:
            self.network.train(was_training)
        return {name: m.compute() for name, m in metrics.items()}

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The network's float32 outputs for ``x`` (eval mode)."""
        was_training = self.network.training
        self.network.eval()
        try:
            return self.network(torch.as_tensor(x).to(self.device)).float()
        finally:
            self.network.train(was_training)

    # -- checkpoints -------------------------------------------------------------------

    def save_checkpoint(
        self, path: str | Path, state: RunState, callbacks: CallbackList | None = None
    ) -> None:
        """Write everything needed to continue exactly: model, optimizer, counters, RNG."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": CHECKPOINT_FORMAT,
            "amp_level": self.amp_level,
            "dtype": str(self.dtype),
            "epoch": state.epoch,
            "step": state.step,
            "model": self.network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "callbacks": None if callbacks is None else callbacks.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "loader": None if self._generator is None else self._generator.get_state(),
            },
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)  # a crash mid-save never leaves a half-written checkpoint

    def _load_checkpoint(self, path: str | Path, state: RunState, callbacks: CallbackList) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"resume={str(path)!r}: no checkpoint file there")
        payload = torch.load(path, map_location=self.device, weights_only=False)
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"resume={str(path)!r} is not a mixprec checkpoint")
        if payload["amp_level"] != self.amp_level or payload["dtype"] != str(self.dtype):
            raise ValueError(
                f"resume={str(path)!r} was saved with amp_level={payload['amp_level']!r}, "
                f"dtype={payload['dtype']}; this Model uses amp_level={self.amp_level!r}, "
                f"dtype={self.dtype}: build the Model the same way to resume"
            )
        self.network.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        if payload["callbacks"] is not None:
            callbacks.load_state_dict(payload["callbacks"])
        rng = payload["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if rng["loader"] is not None and self._generator is not None:
            self._generator.set_state(rng["loader"].cpu())
        state.epoch, state.step = payload["epoch"], payload["step"]
        state.skipped_steps = int(self.optimizer.skipped_steps)
