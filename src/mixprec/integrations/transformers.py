"""``MixprecTrainer``: a ``transformers.Trainer`` that trains at a mixprec amp level.

::

    trainer = MixprecTrainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0),
                             train_dataset=ds, level="O2", dtype=torch.bfloat16)
    trainer.train()                                   # or train(resume_from_checkpoint=...)

Leave ``fp16``/``bf16`` in ``TrainingArguments`` False: the level sets the precision.
When training starts, :meth:`MixprecTrainer.create_optimizer` builds the Trainer's
optimizer as usual (or takes the one passed in ``optimizers=``) and hands model and
optimizer to :func:`mixprec.integrations.accelerate.prepare_amp`, which applies the level
(float32 master weights at O2), wraps the optimizer in a
:class:`~mixprec.LossScaleOptimizer` and makes the Trainer's ``Accelerator`` scale,
unscale and skip through it. From there the Trainer's own loop does the rest:
``accelerator.backward`` scales the loss, ``max_grad_norm`` clips the true gradients
(and the logged ``grad_norm`` is the true norm), an overflowed step is skipped and the
LR scheduler does not advance on it (``accelerator.optimizer_step_was_skipped``).
Checkpoints are the Trainer's: ``optimizer.pt`` carries the loss scale, counters and
float32 masters, ``scaler.pt`` the loss scale, and ``train(resume_from_checkpoint=...)``
continues exactly. The loss scale and skipped steps are logged with the Trainer's logs
(``mixprec/loss_scale``, ``mixprec/skipped_steps``).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.integrations._common import check_level, level_loss_scale, require
from mixprec.integrations.accelerate import LossScaleOptimizerScaler, prepare_amp
from mixprec.optim import LossScaleOptimizer

require("transformers", "hf", __name__)

from transformers import Trainer  # noqa: E402

__all__ = ["MixprecTrainer"]


class MixprecTrainer(Trainer):
    """``transformers.Trainer`` at an amp level, with mixprec's loss scaling.

    Takes every argument of ``Trainer``, plus (keyword-only) ``level``, ``dtype`` and
    ``loss_scale`` as in :func:`mixprec.amp.initialize` (``auto`` decides by the
    Trainer's device). Bad values raise before the Trainer is built:

    >>> MixprecTrainer(model=torch.nn.Linear(2, 2), level="O7")
    Traceback (most recent call last):
    ...
    ValueError: level must be one of O0, O1, O2, O3, lean, auto, got 'O7'
    """

    def __init__(
        self,
        *args: Any,
        level: str = "O2",
        dtype: torch.dtype = torch.bfloat16,
        loss_scale: Any = None,
        **kwargs: Any,
    ) -> None:
        checked_level, checked_dtype = check_level(level, dtype, "cpu")  # validates
        level_loss_scale(loss_scale, checked_level, checked_dtype)  # validates the spec
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and (training_args.fp16 or training_args.bf16):
            raise ValueError(
                f"TrainingArguments has fp16={training_args.fp16}, bf16={training_args.bf16}: "
                "Accelerate's autocast would run on top of the level; leave both False, "
                f"MixprecTrainer(level={level!r}, dtype={dtype}) sets the precision"
            )
        self.mixprec_level, self.mixprec_dtype, self.mixprec_loss_scale = level, dtype, loss_scale
        super().__init__(*args, **kwargs)

    def _mixprec_optimizer(self) -> LossScaleOptimizer | None:
        opt = self.optimizer
        while opt is not None and not isinstance(opt, LossScaleOptimizer):
            opt = getattr(opt, "optimizer", None)  # under Accelerate's wrapper
        return opt

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, wrapped for the level (the level is applied to the model here)."""
        mine = self._mixprec_optimizer()
        if mine is not None:
            scaler = self.accelerator.scaler
            if isinstance(scaler, LossScaleOptimizerScaler) and mine in scaler.optimizers:
                return self.optimizer  # a later train() on the same Trainer
            raise TypeError(
                "optimizers= holds a LossScaleOptimizer; pass the plain optimizer: "
                f"MixprecTrainer wraps it for level {self.mixprec_level!r} with its loss scale"
            )
        optimizer = super().create_optimizer(model)
        _, self.optimizer = prepare_amp(
            self.accelerator, self.model if model is None else model, optimizer,
            level=self.mixprec_level, dtype=self.mixprec_dtype, loss_scale=self.mixprec_loss_scale,
        )  # fmt: skip
        return self.optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs, plus ``mixprec/loss_scale`` and ``mixprec/skipped_steps`` in training."""
        opt = self._mixprec_optimizer()
        if opt is not None and "loss" in logs:  # a training log (evaluation logs have eval_*)
            logs = {
                **logs,
                "mixprec/loss_scale": float(opt.loss_scale),
                "mixprec/skipped_steps": int(opt.skipped_steps),
            }
        super().log(logs, *args, **kwargs)
