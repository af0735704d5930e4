"""One training step as a callable: forward, float32 loss, (scaled) backward, optimizer step.

>>> import torch
>>> from mixprec import amp
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
>>> net, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O2",
...                           torch.bfloat16, loss_scale=128.0)
>>> step = TrainStep(net, opt, torch.nn.functional.cross_entropy)
>>> loss = step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
>>> loss.dtype, float(opt.loss_scale), int(opt.iterations)
(torch.float32, 128.0, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._checks import check_instance
from mixprec.optim import LossScaleOptimizer


class TrainStep:
    """``step(*inputs, target) -> loss``: one optimizer step on one batch.

    The last positional argument is the target unless ``target=`` is given by
    keyword; with ``loss_fn=None`` the model returns the loss itself and every
    argument is a model input.

    Algorithm::

        optimizer.zero_grad()
        loss = loss_fn(model(*inputs), target)           # model output is float32
        self.backward(loss)     # LossScaleOptimizer: scale_loss(loss).backward(); else backward
        optimizer.step()        # LossScaleOptimizer: unscale, check, skip or apply, update scale
        return loss.detach()

    Subclasses change how gradients are made by overriding :meth:`backward`.
    Host syncs: only the optimizer's (one per step for a ``LossScaleOptimizer`` over a
    non-fused optimizer).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        check_instance("model", model, nn.Module, "a torch.nn.Module")
        check_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn

    def backward(self, loss: torch.Tensor) -> None:
        """Compute the gradients of ``loss``: scaled when the optimizer scales losses."""
        # Checked per call: a wrapper may swap the optimizer after construction.
        if isinstance(self.optimizer, LossScaleOptimizer):
            self.optimizer.scale_loss(loss).backward()
        else:
            loss.backward()

    def __call__(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        has_target = "target" in kwargs
        target = kwargs.pop("target", None)
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}; only target= is taken")
        if self.loss_fn is not None and not has_target:
            if len(inputs) < 2:
                raise TypeError(
                    f"step needs the model inputs and a target, got {len(inputs)} argument(s); "
                    "call step(x, y) or step(x, target=y)"
                )
            inputs, target = inputs[:-1], inputs[-1]
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(*inputs)
        loss = output if self.loss_fn is None else self.loss_fn(output, target)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ValueError(
                f"the loss must be a one-element tensor, got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        self.backward(loss)
        self.optimizer.step()
        return loss.detach()
