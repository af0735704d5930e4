"""Mixed precision on module granularity: policies per module and levels O0-O3.

* :func:`initialize` - levels O0-O3, lean and ``auto`` for a whole model and its optimizer;
  :func:`choose_auto` - the level and dtype ``auto`` picks on a device, and why.
* :func:`set_policy`, :func:`to_float` - a :class:`~mixprec.Policy` for one module
  (one layer's own precision).
* :func:`get_white_list`, :func:`get_black_list` - the default allow / deny lists, to
  start lists of one's own from (O1 with the defaults is ``torch.autocast``).

Two internal modules: ``_levels`` (the levels: plan, lists, the hardware's choice)
and ``_casting`` (per-module policies, the cast hooks and their cache).

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

from mixprec.amp._casting import compute_dtype, get_policy, set_policy, to_float
from mixprec.amp._levels import LEVELS, choose_auto, get_black_list, get_white_list, initialize

__all__ = [
    "LEVELS",
    "initialize",
    "choose_auto",
    "set_policy",
    "to_float",
    "get_policy",
    "compute_dtype",
    "get_white_list",
    "get_black_list",
]
