"""``diagnose(model, loss_fn, batches)``: run a few batches and report what a dtype would do.

For every batch: forward with hooks on every submodule (each output tensor is
counted into an exponent histogram, and a gradient hook on it counts the gradient
flowing back), the loss, backward, then every parameter's value and gradient. Only
histograms are kept (257 counters per tensor kind), never the tensors, so memory
does not grow with the batches, and nothing is read back to the host until the end.

The model runs as it is, normally in float32: the report says what *would* underflow
or overflow in ``dtype``, which a float16 run could not tell (its overflowed values
are already inf, its underflowed ones already zero). The model is left as it was:
its ``.grad`` fields and buffers (e.g. BatchNorm running statistics) are restored.

>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> batches = [(torch.randn(16, 4), torch.randint(0, 2, (16,))) for _ in range(2)]
>>> report = diagnose(net, torch.nn.functional.cross_entropy, batches)
>>> list(report.layers)
['0', '0.weight', '0.bias', '1', '2', '2.weight', '2.bias']
>>> report.at_risk, report.recommended_loss_scale >= 1
((), True)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mixprec._checks import as_low_precision, check_instance, check_number
from mixprec.diagnostics._histogram import ExponentHistogram
from mixprec.diagnostics._layers import LayerStats
from mixprec.diagnostics._report import PrecisionReport


def _floating(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Recorder:
    """Forward hooks on every submodule; histograms per (name, tensor kind)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.modules = [(n, m) for n, m in model.named_modules() if n]
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.hist: dict[tuple[str, str], ExponentHistogram] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules]
        # The model's inputs too: a level casts them to the low dtype on entry.
        self.handles.append(model.register_forward_pre_hook(self._record_inputs))

    def _record_inputs(self, module: nn.Module, args: Any) -> None:
        for x in _floating(args):
            self._get("", "input").add(x)

    def _get(self, name: str, tensor: str) -> ExponentHistogram:
        if (name, tensor) not in self.hist:
            self.hist[(name, tensor)] = ExponentHistogram(dtype=self.dtype)
        return self.hist[(name, tensor)]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            for out in _floating(output):
                self._get(name, "activation").add(out)
                if out.requires_grad:
                    out.register_hook(lambda g: self._get(name, "activation_grad").add(g))

        return record

    def record_params(self) -> None:
        for name, p in self.params:
            self._get(name, "value").add(p)
            if p.grad is not None:
                self._get(name, "grad").add(p.grad)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def layers(self, dtype: torch.dtype) -> list[LayerStats]:
        """Modules in registration order, each followed by its own parameters."""
        own = {id(p): n for n, p in self.params}
        order: list[tuple[str, str]] = []
        seen: set[str] = set()
        root_params = [n for n, p in self.params if "." not in n]
        order += [(n, "parameter") for n in root_params]
        for mname, module in self.modules:
            order.append((mname, "module"))
            for p in module.parameters(recurse=False):
                pname = own.get(id(p))
                if pname is not None and pname not in seen and pname.startswith(mname + "."):
                    order.append((pname, "parameter"))
                    seen.add(pname)
        kinds = {"parameter": ("value", "grad"), "module": ("activation", "activation_grad")}
        stats = []
        for name, kind in order:
            tensors = {
                t: self.hist[(name, t)].read() for t in kinds[kind] if (name, t) in self.hist
            }
            if tensors:
                stats.append(LayerStats(name, kind, dtype, tensors))
        return stats


def _split(batch: Any, index: int) -> tuple[Sequence[Any], dict[str, Any], Any]:
    """A batch as (positional inputs, keyword inputs, target): a mapping is a Hugging
    Face batch, the model's keyword arguments and the loss function's target at once."""
    if isinstance(batch, Mapping):
        return [], dict(batch), batch
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ValueError(
            f"batches[{index}] must be an (inputs, target) pair or a dict of the model's "
            f"keyword arguments, got {type(batch).__name__}; pass e.g. a DataLoader of "
            "(x, y) or a list of (x, y) tuples"
        )
    *inputs, target = batch
    if len(inputs) == 1 and isinstance(inputs[0], Mapping):
        return [], dict(inputs[0]), target
    if len(inputs) == 1 and isinstance(inputs[0], (list, tuple)):
        inputs = list(inputs[0])
    return inputs, {}, target


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def diagnose(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Iterable[Any],
    dtype: Any = torch.float16,
    *,
    max_batches: int | None = None,
    tolerance: float = 0.01,
    margin_bits: int = 4,
    horizon_bits: int | None = 24,
) -> PrecisionReport:
    """Run ``batches`` through ``model`` and report what ``dtype`` would do to each layer.

    Args:
        model: the network, as it is normally trained (float32 recommended).
        loss_fn: ``loss_fn(model(*inputs), target) -> scalar loss``.
        batches: an iterable of ``(inputs, target)`` pairs (a ``DataLoader`` works);
            ``inputs`` is a tensor, a tuple of tensors, or a dict of keyword arguments.
            A batch that is a dict (a Hugging Face batch) is both: ``model(**batch)``,
            then ``loss_fn(output, batch)`` (``lambda out, batch: out.loss`` for a model
            given its labels). Tensors move to the model's device.
        dtype: the low-precision dtype to assess, ``torch.float16`` or ``torch.bfloat16``.
        max_batches: stop after this many batches (default: all of ``batches``).
        tolerance, margin_bits, horizon_bits: see :class:`~mixprec.diagnostics.PrecisionReport`.

    Returns a :class:`~mixprec.diagnostics.PrecisionReport` (``report.layers``,
    ``report.recommended_loss_scale``, ``report.at_risk``, ``print(report)``,
    ``report.save(folder)``). One host sync per histogram at the end; none per batch.
    A model with float8 layers (:mod:`mixprec.float8`) runs them in float8, and the
    report carries their amax, scales and saturated fractions from the last batch
    (``report.float8``); the model's buffers, float8 state included, are restored.
    """
    check_instance("model", model, nn.Module, "a torch.nn.Module")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(output, target), got {loss_fn!r}")
    dtype = as_low_precision(dtype, "dtype")
    check_number("max_batches", max_batches, integer=True, minimum=1, allow_none=True)
    check_number("tolerance", tolerance, minimum=0, maximum=1)
    check_number("margin_bits", margin_bits, integer=True, minimum=0)
    check_number("horizon_bits", horizon_bits, integer=True, minimum=1, allow_none=True)
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Iterable):
        raise TypeError(
            f"batches must be an iterable of (inputs, target) pairs, got {type(batches).__name__}"
        )
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")

    saved_grads = {p: p.grad for p in model.parameters()}
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    recorder = _Recorder(model, dtype)
    count = 0
    try:
        for index, batch in enumerate(batches):
            if max_batches is not None and index >= max_batches:
                break
            inputs, keywords, target = _split(batch, index)
            for p in saved_grads:
                p.grad = None
            output = model(*[_to(x, device) for x in inputs],
                           **{k: _to(x, device) for k, x in keywords.items()})  # fmt: skip
            loss = loss_fn(output, _to(target, device))
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise ValueError(
                    f"loss_fn must return a one-element tensor, got "
                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
                )
            if not loss.requires_grad:
                raise ValueError(
                    "the loss does not depend on any parameter that requires grad: nothing to "
                    "diagnose (is the model frozen, or run under torch.no_grad()?)"
                )
            loss.reshape(()).float().backward()
            recorder.record_params()
            count += 1
        # Imported here: mixprec.float8 loads only for a diagnosis, not with the package.
        from mixprec.float8 import read_float8_stats

        float8 = read_float8_stats(model) or None  # before the buffers are restored
    finally:
        recorder.remove()
        for p, grad in saved_grads.items():
            p.grad = grad
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    if count == 0:
        raise ValueError("batches yielded no batch: pass at least one (inputs, target) pair")
    inputs = recorder.hist.get(("", "input"))
    return PrecisionReport(
        recorder.layers(dtype),
        dtype,
        inputs=None if inputs is None else inputs.read(),
        tolerance=tolerance,
        margin_bits=margin_bits,
        horizon_bits=horizon_bits,
        batches=count,
        float8=float8,
    )
