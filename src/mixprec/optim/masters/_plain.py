"""``master_weights=False``: the model's parameters are stepped as they are."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.loss_scale import step_or_skip
from mixprec.optim._clipping import decay_


class ModelParameters:
    """The :class:`~mixprec.optim.masters.Masters` of no master weights: the inner
    optimizer steps the model's own parameters, whatever their dtype.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> plain = ModelParameters(torch.optim.SGD([w], lr=0.5))
    >>> w.grad = torch.ones(2)
    >>> plain.step(torch.zeros(()), skip=True, weight_decay=None, applied=None,
    ...            step_kwargs=None, fused=False)
    (False, tensor(0.))
    >>> w.detach().tolist()
    [0.5, 0.5]
    """

    option: bool | str = False
    stateful = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @staticmethod
    def check(optimizer: torch.optim.Optimizer) -> None:
        """Any optimizer will do."""

    @property
    def model_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def grads_to_masters(self) -> None:
        """Nothing to copy: the inner optimizer reads the parameters' own gradients."""

    def gradients_to_check(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.model_params]

    def show_masters_in_model(self) -> None:
        """Nothing to show: the parameters are what is stepped."""

    def restore_model(self) -> None:
        """Nothing shown, nothing to give back."""

    def fuses(self) -> bool:
        return False

    def step(
        self,
        found_inf: torch.Tensor | None,
        *,
        skip: bool,
        weight_decay: float | None,
        applied: torch.Tensor | None,
        step_kwargs: dict[str, Any] | None,
        fused: bool,
    ) -> tuple[bool, torch.Tensor | None]:
        """Decoupled decay (``weight_decay``, by ``applied``), then the inner step unless
        ``skip`` and ``found_inf``. Returns (whether the host saw a skip, ``found_inf``)."""
        assert found_inf is not None and not fused  # no fused step: the wrapper checked
        if weight_decay and applied is not None:
            with torch.no_grad():
                decay_(self.optimizer.param_groups, weight_decay, applied)
        _, skipped = step_or_skip(self.optimizer, found_inf, skip=skip, kwargs=step_kwargs)
        return skipped, found_inf

    def masters_to_model(self) -> None:
        """Nothing to copy: the step wrote the parameters."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: the inner optimizer's ``zero_grad`` clears the gradients."""

    def add_param_group(self, group: dict[str, Any]) -> dict[str, Any]:
        return group

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load (the wrapper refuses a checkpoint with master weights)."""
