"""Exponential moving average of parameters, updated only on applied steps.

The average starts as a copy of the parameters at the first
applied step and then follows ``avg = m * avg + (1 - m) * param``. Every update
takes an ``applied`` flag tensor (0 on a skipped step), so a skipped step leaves
the average untouched without a host sync. Averages are kept in float32 even
for float16/bfloat16 parameters, where a 0.99 average would otherwise round away.

>>> import torch
>>> p = [torch.tensor([0.0])]
>>> ema = ParameterEMA(p, momentum=0.5)
>>> p[0] += 4.0; ema.update(p, applied=torch.tensor(1.0), iterations=torch.tensor(0))
>>> ema.averages[0]            # first step: a copy
tensor([4.])
>>> p[0] += 4.0; ema.update(p, applied=torch.tensor(1.0), iterations=torch.tensor(1))
>>> ema.averages[0]
tensor([6.])
>>> p[0] += 4.0; ema.update(p, applied=torch.tensor(0.0), iterations=torch.tensor(2))
>>> ema.averages[0]            # skipped step: unchanged
tensor([6.])
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._checks import check_number
from mixprec.numerics import local_shards


class ParameterEMA:
    """Moving averages of a list of parameters (float32 copies)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        momentum: float = 0.99,
        overwrite_frequency: int | None = None,
    ) -> None:
        check_number("ema_momentum", momentum, minimum=0, maximum=1)
        check_number(
            "ema_overwrite_frequency", overwrite_frequency, integer=True, minimum=1,
            allow_none=True,
        )  # fmt: skip
        self.momentum = float(momentum)
        self.overwrite_frequency = overwrite_frequency
        self.averages = [p.detach().float().clone() for p in params]

    def update(
        self, params: list[torch.Tensor], applied: torch.Tensor, iterations: torch.Tensor
    ) -> None:
        """Fold ``params`` into the averages if ``applied`` (a 0/1 tensor) is 1.

        ``iterations`` is the number of applied steps before this one: at 0 the
        average becomes a copy. If an overwrite frequency is set, every that many
        applied steps the parameters are overwritten by their averages.
        """
        if not params:
            return
        first = (iterations == 0).to(torch.float32)
        # weight = (1 - m_eff) * applied, with m_eff = 0 on the very first applied step.
        weight = (1.0 - self.momentum * (1.0 - first)) * applied.to(torch.float32)
        with torch.no_grad():
            # A 0-dim tensor weight (no host sync) is accepted at run time; torch's stubs
            # list only numbers, number sequences and tensor lists.
            torch._foreach_lerp_(
                self.averages, [p.float() for p in params], weight  # type: ignore[call-overload]
            )
            if self.overwrite_frequency is not None:
                due = ((iterations + 1) % self.overwrite_frequency == 0).to(torch.float32)
                self.copy_into(params, weight=due * applied.to(torch.float32))

    def copy_into(self, params: list[torch.Tensor], weight: torch.Tensor | None = None) -> None:
        """Write the averages into ``params`` (all of it, or ``weight`` in [0, 1] of it)."""
        with torch.no_grad():
            if weight is None:
                torch._foreach_copy_(local_shards(params), local_shards(self.averages))
                return
            for p, avg in zip(params, self.averages):
                p.lerp_(avg.to(p.dtype), weight.to(p.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {"averages": [a.clone() for a in self.averages]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        averages = state["averages"]
        if len(averages) != len(self.averages) or any(
            a.shape != b.shape for a, b in zip(averages, self.averages)
        ):
            raise ValueError(
                "EMA state does not match the optimizer's parameters (count or shapes)"
            )
        for mine, saved in zip(self.averages, averages):
            mine.copy_(saved)
