"""``StepCounters``: what a loss-scaled optimizer has done, kept in tensors.

Applied steps, skipped steps and the last step's overflow flag live in small tensors
on the gradients' device and change in place. Nothing reads them back to the host
while training, and under ``torch.compile`` their updates are part of the graph
(Python-side counters mutated after a graph break would be lost or replayed).

>>> import torch
>>> c = StepCounters()
>>> c.record(torch.tensor(0.0)); c.record(torch.tensor(1.0)); c.record(torch.tensor(0.0))
>>> int(c.applied), int(c.skipped), bool(c.last_found_inf)
(2, 1, False)
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._checks import check_number

__all__ = ["StepCounters"]


class StepCounters:
    """Applied and skipped steps (int64 tensors) and the last ``found_inf`` flag."""

    def __init__(self) -> None:
        self.applied = torch.zeros((), dtype=torch.int64)
        self.skipped = torch.zeros((), dtype=torch.int64)
        self.last_found_inf = torch.zeros((), dtype=torch.float32)

    def _follow(self, device: torch.device) -> None:
        # A one-time move to the gradients' device: counting never copies a flag back.
        if self.applied.device != device:
            self.applied = self.applied.to(device)
            self.skipped = self.skipped.to(device)
            self.last_found_inf = self.last_found_inf.to(device)

    def record(self, found_inf: torch.Tensor) -> None:
        """Count one step: skipped if ``found_inf`` (a 0/1 float tensor) is 1. No host sync."""
        self._follow(found_inf.device)
        overflow = found_inf > 0
        self.skipped.add_(overflow)
        self.applied.add_(~overflow)
        self.last_found_inf.copy_(found_inf)

    def set_applied(self, value: Any) -> None:
        """Set the applied-step count (``opt.iterations = n``), e.g. when resuming."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = int(value)
        check_number("iterations", value, integer=True, minimum=0)
        self.applied.fill_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "iterations": self.applied.clone(),
            "skipped_steps": self.skipped.clone(),
            "last_step_skipped": self.last_found_inf > 0,
        }

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` is :meth:`state_dict`'s output."""
        keys = {"iterations", "skipped_steps", "last_step_skipped"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"counters must be a dict with keys {sorted(keys)}, got {state!r}")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"counters[{key!r}] must be a one-element tensor, got {value!r}")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.check_state(state)
        self.applied.copy_(state["iterations"].reshape(()))
        self.skipped.copy_(state["skipped_steps"].reshape(()))
        self.last_found_inf.copy_(state["last_step_skipped"].reshape(()).float())
