"""What a master-weight mode provides: the :class:`Masters` protocol."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Masters(Protocol):
    """The part of a :class:`~mixprec.LossScaleOptimizer` that owns what is stepped.

    A mode takes the model's low-precision parameters from the inner optimizer when it
    is built and, from then on, is all the wrapper knows of them. One step, as the
    wrapper calls it::

        grads_to_masters()                 # gradients go where the step reads them
        gradients_to_check()               # the tensors whose inf/NaN are this step's
        show_masters_in_model()            # unscale_(): p.data, p.grad show the masters
        restore_model()                    # ... and their own storage back
        step(found_inf, ...)               # the update, skipped if found_inf; fused or not
        masters_to_model()                 # after the EMA: the model gets the result

    ``fuses()`` says whether the next step can be the mode's fused one (no float32
    master gradient in memory); ``step(None, fused=True)`` then checks the gradients
    itself. ``stateful`` is False for a mode with nothing to checkpoint (its
    ``state_dict()`` is then ``None``). The registry (:data:`MODES`) has a row per mode.
    """

    #: Whether :meth:`state_dict` holds anything (``False``: the checkpoint's entry is None).
    stateful: bool

    @property
    def option(self) -> bool | str:
        """What ``LossScaleOptimizer.master_weights`` reports: False, True (float32) or a
        mode's name."""

    @property
    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters, in group order."""

    def grads_to_masters(self) -> None: ...

    def gradients_to_check(self) -> list[torch.Tensor | None]: ...

    def show_masters_in_model(self) -> None: ...

    def restore_model(self) -> None: ...

    def fuses(self) -> bool: ...

    def step(
        self,
        found_inf: torch.Tensor | None,
        *,
        skip: bool,
        weight_decay: float | None,
        applied: torch.Tensor | None,
        step_kwargs: dict[str, Any] | None,
        fused: bool,
    ) -> tuple[bool, torch.Tensor | None]: ...

    def masters_to_model(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def add_param_group(self, group: dict[str, Any]) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
