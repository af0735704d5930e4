"""Trainer integrations: mixprec inside the trainers people already use.

* :mod:`mixprec.integrations.lightning` - :class:`~mixprec.integrations.lightning.MixprecPrecision`,
  a Lightning ``Precision`` plugin (``pip install "mixprec[lightning]"``).
* :mod:`mixprec.integrations.accelerate` - :func:`~mixprec.integrations.accelerate.prepare_amp`
  makes an ``accelerate.Accelerator`` scale, unscale and skip through mixprec
  (``pip install "mixprec[hf]"``).
* :mod:`mixprec.integrations.transformers` - :class:`~mixprec.integrations.transformers.MixprecTrainer`,
  a ``transformers.Trainer`` at an amp level (``pip install "mixprec[hf]"``).

Each applies an amp level (O0-O3, ``auto``) to the model, wraps the optimizer in a
:class:`~mixprec.LossScaleOptimizer` (float32 master weights at O2, the level's loss
scale), unscales before the trainer clips, skips overflowed steps and keeps the
loss scale in the trainer's own checkpoints. Importing this package imports none
of those libraries; each submodule imports its own and, when it is missing,
raises ``ImportError`` naming the extra to install.
"""

__all__: list[str] = []
