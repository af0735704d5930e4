"""Mixed precision on module granularity: policies per module and levels O0-O3.

* :func:`initialize` - levels O0-O3, lean and ``auto`` for a whole model and its optimizer;
  :func:`choose_auto` - the level and dtype ``auto`` picks on a device, and why.
* :func:`set_policy`, :func:`to_float` - a :class:`~mixprec.Policy` for one module
  (one layer's own precision).
* :data:`LEVEL_SPECS` - what each level does, as data: one frozen :class:`LevelSpec` per
  level (storage, casts, default loss scale and master weights, optimizer state).
* :func:`get_white_list`, :func:`get_black_list` - the default allow / deny lists, to
  start lists of one's own from (O1 with the defaults is ``torch.autocast``).

The internal modules hold one concept each: the level specs (``_level_specs``),
``initialize`` (``_initialize``), the plan of a level (``_level_plan``), the choice of
``auto`` (``_auto``), the lists (``_lists``), per-module policies (``_module_policy``),
the claim of a model by one API (``_claim``), the hooks (``_cast_hooks``), their cast
cache and per-thread state (``_cast_cache``) and their path under ``torch.compile``
(``_traced_hooks``).

>>> import torch
>>> from mixprec import amp
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
>>> net, opt = amp.initialize(net, opt, level="O1", dtype=torch.bfloat16)
>>> loss = net(torch.randn(16, 4)).square().mean()      # under torch.autocast; output float32
>>> opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()
>>> net[0].weight.dtype, int(opt.iterations)
(torch.float32, 1)
"""

from mixprec.amp._auto import choose_auto
from mixprec.amp._initialize import initialize
from mixprec.amp._level_specs import LEVEL_SPECS, LEVELS, LevelSpec
from mixprec.amp._lists import get_black_list, get_white_list
from mixprec.amp._module_policy import compute_dtype, get_policy, set_policy, to_float

__all__ = [
    "LEVELS",
    "LEVEL_SPECS",
    "LevelSpec",
    "initialize",
    "choose_auto",
    "set_policy",
    "to_float",
    "get_policy",
    "compute_dtype",
    "get_white_list",
    "get_black_list",
]
