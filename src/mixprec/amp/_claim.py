"""Record which mixed-precision API a model went through, so two are never mixed.

The seed systems allow only one of their two mixed-precision APIs on a model
(the per-module policy / amp-level API, or the graph rewrite): applying both
makes casts fight each other. Each entry point claims the model first.

>>> import torch
>>> net = torch.nn.Linear(2, 2)
>>> claim_model(net, "amp")
>>> claim_model(net, "rewrite")
Traceback (most recent call last):
...
ValueError: model already uses the mixprec 'amp' API; ...
"""

from __future__ import annotations

from torch import nn

_ATTR = "_mixprec_api"

_HOW_TO_FIX = {
    "amp": "the model already went through amp.initialize / to_float / a policy",
    "rewrite": "the model is already a graph-rewritten module",
}


def model_api(model: nn.Module) -> str | None:
    """Return the mixed-precision API name recorded on ``model`` (or ``None``)."""
    return getattr(model, _ATTR, None)


def claim_model(model: nn.Module, api: str) -> None:
    """Mark ``model`` as using ``api``; raise ``ValueError`` if another API (or the
    rewrite, twice) already claimed it. Claiming ``"amp"`` twice is allowed: per-module
    overrides can be layered."""
    current = model_api(model)
    if current is not None and (current != api or api == "rewrite"):
        raise ValueError(
            f"model already uses the mixprec {current!r} API; "
            f"{_HOW_TO_FIX.get(current, '')}. Only one mixed-precision API can be used on a "
            f"model: start again from the float32 model to use {api!r}."
        )
    object.__setattr__(model, _ATTR, api)


def claim_tree(model: nn.Module) -> None:
    """Mark ``model`` and its submodules as using the amp API.

    Raises ``ValueError`` (changing nothing) if any of them went through the graph
    rewrite: only one mixed-precision API can be used on a model.
    """
    modules = list(model.modules())
    for module in modules:
        if model_api(module) not in (None, "amp"):
            claim_model(module, "amp")  # raises, naming the other API
    for module in modules:
        claim_model(module, "amp")

