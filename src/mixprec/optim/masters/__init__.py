"""Master weights: what a :class:`~mixprec.LossScaleOptimizer` steps for low-precision
parameters, as one protocol and one registry.

Low-precision parameters lose every update smaller than half a unit in the last
place, so a mode steps something else and writes the result into the model. Every
mode implements :class:`Masters`; :data:`MODES` has a row per mode (its name, what it
needs, bytes per parameter, whether it has a fused step, how it is built), and
everything that lists modes (``master_weights=``, the amp levels, the command line,
the integrations, the docs) reads it. Adding a mode is one file and one row
(docs/development.md).

=============  ===============================================  ==============
mode           what is stepped                                  B/param AdamW
=============  ===============================================  ==============
``"none"``     the model's parameters as they are (``False``)   6 (bfloat16)
``"fp32"``     float32 copies (:class:`MasterWeights`)           14
``"split"``    float32 rebuilt from weight + 16 bits            12.125
``"split8"``   float32 rebuilt from weight + 8 bits             11 (7 w/ AdamW8bit)
``"kahan"``    the weights, a compensation buffer kept          8
``"stochastic"`` the weights, stochastically rounded            6
=============  ===============================================  ==============

>>> import torch
>>> from mixprec.optim.masters import MODES, build_masters
>>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
>>> masters = build_masters(torch.optim.SGD([w], lr=0.1), "fp32")
>>> type(masters).__name__, masters.option, MODES["fp32"].bytes_per_parameter
('MasterWeights', True, 14.0)
"""

from mixprec.optim.masters._float32 import MasterWeights
from mixprec.optim.masters._lean import LeanUpdates
from mixprec.optim.masters._plain import ModelParameters
from mixprec.optim.masters._protocol import Masters
from mixprec.optim.masters._registry import (
    MASTER_WEIGHT_MODES,
    MODES,
    MasterMode,
    build_masters,
    master_weight_mode,
    mode_of,
)
from mixprec.optim.masters._split import Split8MasterWeights, SplitMasterWeights

__all__ = [
    "Masters", "MasterMode", "MODES", "MASTER_WEIGHT_MODES", "master_weight_mode", "mode_of",
    "build_masters", "ModelParameters", "MasterWeights", "SplitMasterWeights",
    "Split8MasterWeights", "LeanUpdates",
]  # fmt: skip
