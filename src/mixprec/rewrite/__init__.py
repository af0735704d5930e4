"""Mixed precision by graph rewrite: the model stays float32, chosen ops run in low precision.

The model is
captured as a ``torch.fx`` graph (``torch.export``, else ``symbolic_trace``);
each op is classified by four lists (Allow, Infer, Deny, Clear), the graph is
painted with the classic painting algorithm, and casts are inserted only where painted
and float32 ops meet: one per value and dtype, none where type promotion already
reads a low-precision input in float32. Parameters stay float32 master weights,
cast inside the graph.

Modules, one concept each: ``defaults`` (the default op lists and their reasons),
``lists`` (op naming, ``AmpLists``, levels, environment overrides), ``nodes``
(reading graph nodes), ``capture`` (torch.export / symbolic_trace, and why a capture
failed), ``outputs`` (outputs a graph cannot return, such as a Hugging Face cache:
taken apart for capture, rebuilt on every call), ``modes`` (train/eval in the graph),
``paint`` (the painting algorithm), ``plan`` (where casts go), ``casts`` (inserting
and simplifying them), ``explain`` (reports, cast counting), ``lazy`` (capture on the
first call), ``api`` (entry points).

Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells) are on the
Allow list, as in the classic lists; a default Hugging Face model (``use_cache=True``,
whose output holds a ``DynamicCache``) is captured whole.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> gm = rewrite(net, torch.randn(4, 8), dtype=torch.bfloat16)
>>> print(explain(gm).summary)
converted 3/3 ops to bfloat16 using 4 casts
>>> lazy = rewrite(torch.nn.Linear(4, 2), dtype=torch.bfloat16)   # captures when first called
>>> lazy(torch.randn(3, 4)).dtype, explain(lazy).summary
(torch.float32, 'converted 1/1 ops to bfloat16 using 2 casts')
"""

from mixprec.rewrite._api import rewrite
from mixprec.rewrite._capture import CaptureError
from mixprec.rewrite._explain import CastCounter, ReportRow, RewriteReport, count_casts, explain
from mixprec.rewrite._lazy import LazyRewrite, RecaptureLimitError
from mixprec.rewrite._lists import (
    ALLOW,
    CLEAR,
    DENY,
    INFER,
    PAINT_LEVELS,
    AmpLists,
    normalize_op_name,
)

__all__ = [
    "ALLOW",
    "CLEAR",
    "DENY",
    "INFER",
    "PAINT_LEVELS",
    "AmpLists",
    "CaptureError",
    "CastCounter",
    "LazyRewrite",
    "RecaptureLimitError",
    "ReportRow",
    "RewriteReport",
    "count_casts",
    "explain",
    "normalize_op_name",
    "rewrite",
]
