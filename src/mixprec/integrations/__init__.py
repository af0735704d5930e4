"""Trainer integrations: mixprec inside the trainers people already use.

* :mod:`mixprec.integrations.lightning` - :class:`~mixprec.integrations.lightning.MixprecPrecision`,
  a Lightning ``Precision`` plugin (``pip install "lightning>=2.6.6,<2.7"``).
* :mod:`mixprec.integrations.accelerate` - :func:`~mixprec.integrations.accelerate.prepare_amp`
  makes an ``accelerate.Accelerator`` scale, unscale and skip through mixprec
  (``pip install "transformers>=5.23,<5.24" "accelerate>=1.15,<1.16"``).
* :mod:`mixprec.integrations.transformers` - :class:`~mixprec.integrations.transformers.MixprecTrainer`,
  a ``transformers.Trainer`` at an amp level (the same two packages).

Each applies an amp level (O0-O3, ``auto``) to the model, wraps the optimizer in a
:class:`~mixprec.LossScaleOptimizer` (float32 master weights at O2, the level's loss
scale), unscales before the trainer clips, skips overflowed steps and keeps the
loss scale in the trainer's own checkpoints. Importing this package imports none
of those libraries; each submodule imports its own and, when it is missing,
raises ``ImportError`` naming the command that installs it; from a checkout of
mixprec, ``pip install -e ".[lightning]"`` or ``pip install -e ".[hf]"`` installs
the same pinned versions (the ``lightning`` and ``hf`` extras of pyproject.toml).
"""

__all__: list[str] = []
