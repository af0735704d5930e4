"""Accelerate at a mixprec amp level: ``prepare_amp(accelerator, model, optimizer, level, dtype)``.

::

    accelerator = Accelerator()                      # mixed_precision="no": mixprec owns it
    model, optimizer = prepare_amp(accelerator, model, optimizer, level="O2", dtype=torch.bfloat16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        accelerator.backward(loss_fn(model(x), y))   # loss * scale
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # unscales first
        optimizer.step()                             # skipped if a gradient is inf/NaN
        optimizer.zero_grad()

:func:`prepare_amp` applies the level with :func:`mixprec.amp.initialize` (the optimizer
becomes a :class:`~mixprec.LossScaleOptimizer`, with float32 master weights at O2) and
installs a :class:`LossScaleOptimizerScaler` as ``accelerator.scaler``: Accelerate
already sends its backward, its step and its checkpoints through ``accelerator.scaler``
with ``torch.amp.GradScaler``'s interface. Accelerate unscales before clipping only
under its own float16 autocast, so :func:`prepare_amp` also points the accelerator's
``unscale_gradients`` (which ``clip_grad_norm_``/``clip_grad_value_`` call) at the
scaler. ``accelerator.optimizer_step_was_skipped`` is true after a skipped step (the
LR scheduler prepared by Accelerate does not advance then), ``accelerator.save_state``
and ``load_state`` resume exactly (the loss scale, counters and masters are in the
optimizer's state dict; ``scaler.pt`` holds the loss scale as well).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec import amp
from mixprec._checks import check_instance, check_number
from mixprec.integrations._common import ScaleReader, check_level, require
from mixprec.loss_scale import LossScale, loss_scale_state, restore_loss_scale
from mixprec.optim import LossScaleOptimizer

require("accelerate", "hf", __name__)

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["prepare_amp", "LossScaleOptimizerScaler"]

# Accelerate's other back ends bring their own loss scaling or sharded optimizers.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LossScaleOptimizerScaler(ScaleReader):
    """``torch.amp.GradScaler``'s interface, as Accelerate calls it, over LossScaleOptimizers
    (and as code that logs ``accelerator.scaler.get_scale()`` or ``._scale`` reads it).

    All the optimizers share one loss scale (as they share one GradScaler in Accelerate)::

        scale(loss)          loss * scale (every optimizer records the scale it used)
        unscale_(opt)        opt.unscale_()                  # once per step
        step(opt)            unscale_ if not done; one host read of the overflow flag;
                             overflow: the wrapper's own step records the skip and backs the
                             scale off, without calling the step method Accelerate watches
                             (so Accelerate reports the step as skipped)
                             else:     opt.step()
        update()             nothing left to do: each step updated the scale

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), loss_scale=8.0)
    >>> scaler = LossScaleOptimizerScaler(opt.loss_scaler)
    >>> scaler.add(opt)
    >>> scaler.scale((w * 2).sum()).backward()
    >>> w.grad
    tensor([16., 16.])
    >>> scaler.step(opt); scaler.update()
    >>> w, int(opt.skipped_steps)
    (Parameter containing:
    tensor([0., 0.], requires_grad=True), 0)
    """

    def __init__(self, loss_scale: LossScale) -> None:
        check_instance("loss_scale", loss_scale, LossScale, "a mixprec.LossScale")
        super().__init__(loss_scale)
        self.optimizers: list[LossScaleOptimizer] = []

    def add(self, optimizer: LossScaleOptimizer) -> None:
        """Let the scaler drive ``optimizer`` (which must share its loss scale)."""
        check_instance("optimizer", optimizer, LossScaleOptimizer, "a LossScaleOptimizer")
        if optimizer.loss_scaler is not self.loss_scale:
            raise ValueError("optimizer must use the scaler's loss scale (one per accelerator)")
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    def _own(self, optimizer: Any) -> LossScaleOptimizer:
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        for opt in self.optimizers:
            if opt is optimizer:
                return opt
        raise TypeError(
            f"{type(optimizer).__name__} was not set up by mixprec.integrations.accelerate."
            "prepare_amp; pass every optimizer through prepare_amp before accelerator.prepare"
        )

    def stepped(self, parameters: Any) -> list[torch.Tensor]:
        """``parameters`` with each model parameter replaced by the tensor its optimizer
        steps (its float32 master at O2, where the unscaled gradient is)."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        stepped = {
            id(p): s
            for opt in self.optimizers
            for p, s in zip(opt.model_params(), (q for g in opt.param_groups for q in g["params"]))
        }
        return [stepped.get(id(p), p) for p in parameters]

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs * scale``; call ``.backward()`` on the result. No host sync."""
        check_instance("outputs", outputs, torch.Tensor, "a torch.Tensor (the loss)")
        if not self.optimizers:
            raise RuntimeError("no optimizer was set up: pass one to prepare_amp()")
        for opt in self.optimizers:  # each records the scale it will unscale by
            scaled = opt.scale_loss(outputs)
        return scaled

    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale in place (once per step)."""
        opt = self._own(optimizer)
        if opt.unscaled:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since its step"
            )
        opt.unscale_()

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """``Accelerator.unscale_gradients``: unscale ``optimizer`` (default: all) unless done."""
        if optimizer is None:
            targets = self.optimizers
        else:
            given = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            targets = [self._own(o) for o in given]
        for opt in targets:
            if not opt.unscaled:
                self.unscale_(opt)

    def step(self, optimizer: Any, closure: Any = None, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold an inf/NaN (reads the flag on the host,
        as ``GradScaler.step`` does)."""
        opt = self._own(optimizer)
        if closure is not None:
            raise RuntimeError("a closure cannot be used with loss scaling: its loss is not scaled")
        if not opt.unscaled:
            self.unscale_(opt)
        # The verdict the step goes by, taken once by unscale_() (one host read).
        found_inf = opt.unscaled_found_inf
        if opt.skip_nonfinite and found_inf is not None and bool(found_inf):
            # The class's step, not the instance attribute Accelerate patched to notice calls.
            return type(opt).step(opt)
        return opt.step(**kwargs)  # through Accelerate's patched method, if any: an applied step

    def update(self, new_scale: float | None = None) -> None:
        """Set the scale to ``new_scale``; without one there is nothing to do (see the class)."""
        if new_scale is not None:
            check_number("new_scale", new_scale, minimum=0, exclusive=True)
            self.loss_scale.scale.fill_(float(new_scale))

    def state_dict(self) -> dict[str, Any]:
        """torch's ``scale`` key plus ``"mixprec"``: the loss scale's kind, config and state."""
        return {"scale": self.get_scale(), "mixprec": loss_scale_state(self.loss_scale)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (checked first; a bad one changes nothing)."""
        if not isinstance(state_dict, dict) or "mixprec" not in state_dict:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a LossScaleOptimizerScaler state dict (no 'mixprec' key), got {got}; "
                "a torch GradScaler's checkpoint cannot resume a mixprec run"
            )
        restore_loss_scale(self.loss_scale, state_dict["mixprec"])


def prepare_amp(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    level: str = "O2",
    dtype: torch.dtype = torch.bfloat16,
    loss_scale: Any = None,
) -> tuple[torch.nn.Module, LossScaleOptimizer | None]:
    """Apply ``level`` to ``model`` and make ``accelerator`` scale through mixprec.

    Call it before ``accelerator.prepare``, once per model (with its optimizer, if it
    trains). Arguments as :func:`mixprec.amp.initialize`; ``auto`` decides by
    ``accelerator.device``. All the optimizers of one accelerator share one loss scale:
    the first call sets it (``loss_scale``, or the level's own), later calls reuse it.
    Returns ``(model, optimizer)``, the optimizer a :class:`~mixprec.LossScaleOptimizer`.
    """
    check_instance("accelerator", accelerator, Accelerator, "an accelerate.Accelerator")
    if accelerator.mixed_precision != "no":
        raise ValueError(
            f"accelerator has mixed_precision={accelerator.mixed_precision!r}: its autocast "
            "would run on top of the level. Create it with Accelerator(mixed_precision='no'); "
            "mixprec sets the precision"
        )
    if accelerator.distributed_type not in _SUPPORTED:
        raise ValueError(
            f"accelerator runs {accelerator.distributed_type}, which brings its own loss "
            f"scaling or sharding; mixprec.integrations.accelerate supports {[str(d) for d in _SUPPORTED]}"
        )
    if isinstance(optimizer, AcceleratedOptimizer) or any(model is m for m in accelerator._models):
        raise ValueError(
            "prepare_amp() comes before accelerator.prepare(): pass the plain model and optimizer"
        )
    if any(not isinstance(o.optimizer, LossScaleOptimizer) for o in accelerator._optimizers):
        # It would step on the scaled gradients of every later accelerator.backward.
        raise ValueError(
            "accelerator already prepared an optimizer that prepare_amp() did not set up; "
            "call prepare_amp() for every training model and optimizer before any prepare()"
        )
    level, dtype = check_level(level, dtype, accelerator.device)
    scaler = accelerator.scaler
    if scaler is not None and not isinstance(scaler, LossScaleOptimizerScaler):
        raise ValueError(
            f"accelerator already has a {type(scaler).__name__}; use a fresh Accelerator"
        )
    if scaler is not None and optimizer is not None:
        if loss_scale is not None and loss_scale is not scaler.loss_scale:
            raise ValueError(
                "this accelerator's optimizers share the loss scale set by the first "
                f"prepare_amp() ({scaler.loss_scale!r}); leave loss_scale=None"
            )
        loss_scale = scaler.loss_scale
    model, optimizer = amp.initialize(model, optimizer, level, dtype, loss_scale=loss_scale)
    if optimizer is not None:
        if scaler is None:
            scaler = LossScaleOptimizerScaler(optimizer.loss_scaler)
            _install(accelerator, scaler)
        scaler.add(optimizer)
    return model, optimizer


def _install(accelerator: Accelerator, scaler: LossScaleOptimizerScaler) -> None:
    """Make ``accelerator`` scale, unscale and clip through ``scaler`` (on this instance)."""
    accelerator.scaler = scaler  # backward, step, save_state/load_state go through it
    # Accelerate unscales before clipping only under its own float16 autocast.
    accelerator.unscale_gradients = scaler.unscale_gradients
    # At O2 the true gradients are the float32 masters': clip those, not the model's copies.
    clip_norm, clip_value = accelerator.clip_grad_norm_, accelerator.clip_grad_value_

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        return clip_norm(scaler.stepped(parameters), max_norm, norm_type)

    def clip_grad_value_(parameters: Any, clip_value_: float) -> None:
        clip_value(scaler.stepped(parameters), clip_value_)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
