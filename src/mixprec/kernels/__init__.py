"""Pure tensor functions behind the optimizer steps: each formula written once.

They import nothing of mixprec above them (only :mod:`mixprec.numerics`), so any
optimizer, master-weight mode or benchmark can use them, and they compile as they are.

* :mod:`~mixprec.kernels.adamw` - AdamW's update (:func:`adamw_moments`,
  :func:`adamw_bias_corrections`, :func:`adamw_direction`) and the step bodies built on
  it: every master-weight format's fused step, ``AdamW8bit``'s chunk update.
* :mod:`~mixprec.kernels.compiled` - those bodies through ``torch.compile``.
* :mod:`~mixprec.kernels.bits` - a float32 master beside its bfloat16 weight in 16 or
  8 more bits (:func:`split_bits`/:func:`join_bits`, :func:`split8_bits`/:func:`join8_bits`),
  bit packing.
* :mod:`~mixprec.kernels.moments8` - Adam's moments in 8-bit block-scaled codes.
* :mod:`~mixprec.kernels.rounding` - stochastic rounding to bfloat16 and its noise.

>>> import torch
>>> from mixprec.kernels import join_bits, split_bits
>>> master = torch.tensor([1.0 + 2.0**-12, -3.0])
>>> weight = master.bfloat16()
>>> torch.equal(join_bits(weight, *split_bits(master, weight)), master)  # exact
True
"""

from mixprec.kernels.adamw import (
    HYPER_NAMES,
    adamw_bias_corrections,
    adamw_direction,
    adamw_moments,
    kahan_adamw_,
    update_chunk,
)
from mixprec.kernels.bits import (
    CORRECTION_STEP,
    join8_bits,
    join_bits,
    pack_bits,
    split8_bits,
    split8_error_bound,
    split_bits,
    unpack_bits,
)
from mixprec.kernels.moments8 import (
    dequantize_first_moment,
    dequantize_second_moment,
    noise_from_bits,
    quantize_first_moment,
    quantize_second_moment,
)
from mixprec.kernels.rounding import add_rounding_noise_, hashed_bits, stochastic_round

__all__ = [
    "HYPER_NAMES", "adamw_moments", "adamw_bias_corrections", "adamw_direction",
    "kahan_adamw_", "update_chunk",
    "CORRECTION_STEP", "split_bits", "join_bits", "split8_bits", "join8_bits",
    "split8_error_bound", "pack_bits", "unpack_bits",
    "quantize_first_moment", "dequantize_first_moment", "quantize_second_moment",
    "dequantize_second_moment", "noise_from_bits",
    "stochastic_round", "add_rounding_noise_", "hashed_bits",
]  # fmt: skip
