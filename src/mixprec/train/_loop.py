"""``Model``: train, evaluate and predict with any amp level, in a few lines.

``Model(network, loss_fn, optimizer, metrics, amp_level).train(epochs, loader)`` runs
the whole loop: the amp level, loss scaling, metrics, callbacks and exact resume from
a checkpoint. One training step reads top to bottom::

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
from typing import TYPE_CHECKING, Any

import torch

from mixprec._checks import as_low_precision, check_bool, check_choice, check_instance, check_number
from mixprec.amp._auto import choose_auto
from mixprec.amp._level_specs import spec_of
from mixprec.loss_scale import loss_scale_from_spec
from mixprec.optim import LossScaleOptimizer
from mixprec.optim.masters import master_weight_mode
from mixprec.train import _checkpoint as checkpoint
from mixprec.train._divergence import DivergenceGuard, resolve_guard
from mixprec.train._names import AMP_LEVELS
from mixprec.train.callbacks import Callback, CallbackList, History, ModelCheckpoint, RunState
from mixprec.train.metrics import build_metric

if TYPE_CHECKING:
    from mixprec.typing import MasterWeights as MasterWeightsOption



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
    """The low-precision dtype: ``None`` (the device's default), a name, or a torch dtype.

    >>> resolve_dtype("bf16", torch.device("cpu")), resolve_dtype(None, torch.device("cpu"))
    (torch.bfloat16, torch.bfloat16)
    """
    if dtype is None:
        return default_low_precision_dtype(device)
    return as_low_precision(dtype, "dtype", hint="use amp_level='O0' to train in float32")


def check_master_weights_option(value: Any, amp_level: str) -> Any:
    """``master_weights=`` for ``Model``: a mode name (checked), or ``None`` for the level's."""
    if value is None:
        return None
    mode = master_weight_mode(value)
    if mode and spec_of(amp_level).forward == "rewrite":
        raise ValueError(
            f"master_weights={value!r} with amp_level='rewrite': the rewrite keeps float32 "
            "parameters, so there is nothing to keep masters of; use amp_level='O2', 'O3' "
            "or 'lean'"
        )
    return value


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
        amp_level: ``"O0"``-``"O3"``, ``"lean"``, ``"auto"`` (:func:`mixprec.amp.initialize`) or ``"rewrite"`` (the
            graph rewrite, built at the first batch). ``"auto"`` is decided here, by the
            device (:func:`mixprec.amp.choose_auto`): ``amp_level`` (and ``dtype``,
            unless it is O0) then hold what it picked, and ``auto_reason`` says why.
        loss_scale: how the loss is scaled before backward: ``None`` for the level's
            default, ``"dynamic"`` (grow the scale while gradients stay finite, shrink it on
            overflow), a positive number for a static scale, or a
            :class:`~mixprec.loss_scale.LossScale` object.
        skip_nonfinite: ``True`` (default) skips an optimizer step whose gradients hold an
            inf or NaN; ``False`` applies every step, overflowing or not.
        divergence: a :class:`~mixprec.train._divergence.DivergenceGuard` that makes
            ``train`` raise ``DivergenceError`` when the loss stays NaN/inf or a weight
            becomes non-finite; ``True`` its defaults, ``False`` none; ``None`` (default)
            its defaults unless ``skip_nonfinite=False`` applies non-finite steps on purpose.
        dtype: the low-precision dtype (default: float16 on CUDA, bfloat16 on CPU).
        device: default CUDA if available, else CPU.
        compile: ``True`` compiles the network in place (``nn.Module.compile``), any level.
        master_weights: what the optimizer steps at O2, O3 and lean (``amp.initialize``'s
            option): ``None`` (default) the level's own, or ``"fp32"``, ``"split"``,
            ``"split8"``, ``"kahan"``, ``"stochastic"``, ``False``.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        loss_fn: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Any = None,
        amp_level: str = "O0",
        loss_scale: Any = None,
        dtype: Any = None,
        device: Any = None,
        *,
        skip_nonfinite: bool = True,
        divergence: DivergenceGuard | bool | None = None,
        compile: bool = False,
        master_weights: MasterWeightsOption | None = None,
    ) -> None:
        check_instance("network", network, torch.nn.Module, "a torch.nn.Module")
        check_choice("amp_level", amp_level, AMP_LEVELS)
        if spec_of(amp_level).by_hardware and dtype is not None:
            raise ValueError(
                f"dtype={dtype!r} with amp_level='auto': auto picks the dtype by the hardware; "
                "leave dtype out, or name a level (e.g. 'O2') to choose the dtype yourself"
            )
        if optimizer is not None:
            check_instance(
                "optimizer",
                optimizer,
                torch.optim.Optimizer,
                "a torch.optim.Optimizer or None",
                hint="pass e.g. optimizer=torch.optim.AdamW(network.parameters())",
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(logits, targets), got {loss_fn!r}")
        self._skip_nonfinite = check_bool("skip_nonfinite", skip_nonfinite)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.auto_reason: str | None = None
        if spec_of(amp_level).by_hardware:
            amp_level, low, self.auto_reason = choose_auto(self.device)
            self.dtype = low if low != torch.float32 else self.dtype  # O0 ignores dtype
        self.amp_level = amp_level
        self.divergence = resolve_guard(divergence, self._skip_nonfinite)
        self.loss_fn = loss_fn if loss_fn is not None else torch.nn.CrossEntropyLoss()
        self.metrics = _build_metrics(metrics)
        self._loss_scale = None if loss_scale is None else loss_scale_from_spec(loss_scale)
        self.network = network.to(self.device)
        self.optimizer: LossScaleOptimizer | None = None
        self._raw_optimizer = optimizer
        self.history: History | None = None
        self._generator: torch.Generator | None = None
        self._ready, self._compile = False, check_bool("compile", compile)
        self._master_weights = check_master_weights_option(master_weights, amp_level)
        if spec_of(amp_level).forward != "rewrite":  # the rewrite is built at the first batch
            self._prepare(None)

    # -- building the mixed-precision network ------------------------------------------

    def _prepare(self, dataset: Any) -> None:
        """Apply the amp level (or the graph rewrite) and wrap the optimizer, once."""
        if self._ready:
            return
        optimizer = self._raw_optimizer
        spec = spec_of(self.amp_level)
        if isinstance(optimizer, LossScaleOptimizer) and not spec.low_precision:
            self.optimizer = optimizer
        elif spec.forward == "rewrite":
            from mixprec.rewrite import rewrite

            example = _example_batch(dataset).to(self.device)
            self.network = rewrite(self.network, (example,), dtype=self.dtype)
            if optimizer is not None:
                self.optimizer = (
                    optimizer
                    if isinstance(optimizer, LossScaleOptimizer)
                    else LossScaleOptimizer(
                        optimizer,
                        loss_scale=self._loss_scale or spec.default_loss_scale(self.dtype),
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
                master_weights=self._master_weights,
            )
        if self.optimizer is not None and not self._skip_nonfinite:
            self.optimizer.skip_nonfinite = False
        if self._compile:
            self.network.compile()
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
        """Forward, float32 loss, scaled backward, step (or skip). Returns (loss, logits).

        ``x`` and ``y`` go to the Model's device first, as in :meth:`predict` and the loops.
        """
        x, y = self._to_device((x, y))
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

        ``callbacks`` get a :class:`~mixprec.train.callbacks.RunState` at each hook; a
        ``History`` is always kept and returned. ``resume`` names a checkpoint written by
        ``ModelCheckpoint``/:meth:`save_checkpoint`: model, optimizer (with loss-scale state,
        master weights, EMA), counters, callbacks and random-number state are restored, so
        the run continues exactly as if it had not stopped (the checkpoint is read with
        ``torch.load(weights_only=True)``: a file that would run code is refused with
        ``UnsafeCheckpointError``, and nothing is changed). With ``eval_dataset``, each
        epoch's metrics include ``val_<name>``. One host sync per step reads the loss and
        the skip flag for the callbacks; the divergence guard adds none per step (see
        :mod:`mixprec.train._divergence`) and raises ``DivergenceError``; a collapsed dynamic
        loss scale raises ``ScaleCollapseError``.
        """
        check_number("epochs", epochs, integer=True, minimum=1, hint="pass e.g. epochs=10")
        self._prepare(train_dataset)
        if self.optimizer is None:
            raise ValueError("this Model has no optimizer: pass optimizer=... to train it")
        callbacks = list(callbacks or [])
        self.history = next((c for c in callbacks if isinstance(c, History)), None)
        if self.history is None:
            self.history = History()
        else:
            callbacks.remove(self.history)
        # After the callbacks that add epoch metrics, before the first checkpoint callback:
        # a checkpoint's history then holds the epoch it was saved at.
        saving = [i for i, c in enumerate(callbacks) if isinstance(c, ModelCheckpoint)]
        callbacks.insert(saving[0] if saving else len(callbacks), self.history)
        cbs = CallbackList(callbacks)
        self._generator = checkpoint.loader_generator(train_dataset)
        state = RunState(
            epochs=epochs,
            steps_per_epoch=len(train_dataset) if hasattr(train_dataset, "__len__") else None,
            model=self.network,
            optimizer=self.optimizer,
            save_checkpoint=lambda path: self.save_checkpoint(path, state, cbs),
        )
        if resume is not None:
            self._load_checkpoint(resume, state, cbs)
        guard = self.divergence
        guard.reset()
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
                if state.skipped:  # a fused step skips on the device: surface a collapse here
                    self.optimizer.loss_scaler.raise_if_collapsed()
                guard.after_step(state, self.network, self.optimizer)
            state.metrics = {name: m.compute() for name, m in self.metrics.items()}
            if eval_dataset is not None:
                state.metrics.update({f"val_{k}": v for k, v in self.eval(eval_dataset).items()})
            guard.check_weights(state, self.network, self.optimizer)  # before any checkpoint
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
        """Write everything needed to continue exactly: model, optimizer, counters, RNG.

        The file's layout is described in :mod:`mixprec.train._checkpoint`.
        """
        checkpoint.save_checkpoint(
            path,
            network=self.network,
            optimizer=self.optimizer,
            state=state,
            amp_level=self.amp_level,
            dtype=self.dtype,
            callbacks=callbacks,
            generator=self._generator,
        )

    def _load_checkpoint(self, path: str | Path, state: RunState, callbacks: CallbackList) -> None:
        checkpoint.load_checkpoint(
            path,
            network=self.network,
            optimizer=self.optimizer,
            state=state,
            amp_level=self.amp_level,
            dtype=self.dtype,
            device=self.device,
            callbacks=callbacks,
            generator=self._generator,
        )
