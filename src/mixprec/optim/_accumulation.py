"""Gradient accumulation over micro-batches, with overflow tracking across the window.

Each micro-batch's gradients arrive already unscaled; they are summed into
float32 buffers together with an "any micro-batch overflowed" flag. At the end of
the window the average is handed out and everything is reset, so nothing of a
window (not even a NaN) leaks into the next one.

>>> import torch
>>> acc = GradientAccumulator(steps=2)
>>> params = [torch.zeros(2)]
>>> acc.add([torch.tensor([1.0, 3.0])], found_inf=torch.tensor(0.0))
False
>>> acc.add([torch.tensor([3.0, 5.0])], found_inf=torch.tensor(0.0))
True
>>> grads, found_inf = acc.pop_average()
>>> grads[0], found_inf
(tensor([2., 4.]), tensor(0.))
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._checks import check_number


def check_accumulation_steps(steps: Any) -> int | None:
    """Validate ``gradient_accumulation_steps`` (``None`` or an integer >= 1)."""
    return check_number(
        "gradient_accumulation_steps", steps, integer=True, minimum=1, allow_none=True,
        hint="use 1 (or None) for no accumulation",
    )  # fmt: skip


class GradientAccumulator:
    """Float32 running sums of gradients over ``steps`` micro-batches."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.micro_step = 0
        self.sums: list[torch.Tensor | None] = []
        self.found_inf: torch.Tensor | None = None

    def add(self, grads: list[torch.Tensor | None], found_inf: torch.Tensor) -> bool:
        """Add one micro-batch's unscaled gradients; return True when the window is full."""
        if not self.sums:
            self.sums = [None] * len(grads)
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is None:
                    continue
                total = self.sums[i]
                if total is None:
                    self.sums[i] = g.detach().float().clone()
                else:
                    total.add_(g)
            flag = found_inf.detach().clone() if self.found_inf is None else self.found_inf
            self.found_inf = torch.maximum(flag, found_inf) if self.found_inf is not None else flag
        self.micro_step += 1
        return self.micro_step >= self.steps

    def pop_average(self) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """Return (average gradients, window found_inf) and start a new window."""
        found_inf = self.found_inf
        if found_inf is None:
            raise RuntimeError("pop_average() on an empty window: add() a micro-batch first")
        with torch.no_grad():
            averages = [None if s is None else s.div_(self.steps) for s in self.sums]
        self.sums, self.found_inf, self.micro_step = [], None, 0
        return averages, found_inf

    def window(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor | None:
        """Add ``params``' gradients; at the end of a window put the averages in their
        ``.grad`` (in each parameter's dtype) and return the window's ``found_inf``,
        otherwise return ``None``."""
        if not self.add([p.grad for p in params], found_inf):
            return None
        averages, found_inf = self.pop_average()
        for p, avg in zip(params, averages):
            p.grad = None if avg is None else avg.to(p.dtype)
        return found_inf

    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_step": self.micro_step,
            "sums": [None if s is None else s.clone() for s in self.sums],
            "found_inf": None if self.found_inf is None else self.found_inf.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_step = int(state["micro_step"])
        self.sums = [None if s is None else s.clone() for s in state["sums"]]
        self.found_inf = None if state["found_inf"] is None else state["found_inf"].clone()
