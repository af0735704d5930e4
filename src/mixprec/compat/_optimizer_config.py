"""The config of a torch optimizer, for the seed systems' ``get_config()``/``from_config()``.

Keras and TensorFlow nest the inner optimizer's config in a loss-scale optimizer's
as ``{"class_name": ..., "config": ...}``. A torch optimizer's config is its class
and hyperparameters, never its parameters: those come back through ``params=``::

    {"module": "torch.optim.sgd", "class_name": "SGD",
     "config": {"lr": 0.1, "momentum": 0.9, ...},      # the constructor's keywords
     "param_groups": [{"lr": 0.01}, {}]}               # only where groups differ

A config that went through Keras's serializer also carries ``"registered_name"``
(``None``, or ``"package>Name"``, which ``custom_objects`` may name as Keras's does).

``config`` holds each constructor keyword at its current value (a learning rate a
scheduler or ``opt.lr = ...`` changed is saved as it is now) when all parameter
groups agree, else at the constructor's value; ``param_groups`` (present only when
needed) lists per group what differs from that. :func:`optimizer_from_config`
rebuilds the class with ``params`` (an iterable of tensors, or torch's list of
parameter-group dicts, one per saved group): same class, same hyperparameters in
every group. Classes come from ``torch.optim`` or ``custom_objects``; nothing is
imported by name from a config.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2))
>>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
>>> cfg = optimizer_config(opt)
>>> cfg["class_name"], cfg["config"]["lr"], cfg["config"]["momentum"]
('SGD', 0.1, 0.9)
>>> again = optimizer_from_config(cfg, [w])
>>> type(again).__name__, again.param_groups[0]["momentum"]
('SGD', 0.9)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

# "registered_name": the key Keras's serializer adds to every config it writes (None for
# a built-in class, "package>Name" for a registered one).
_KEYS = {"module", "class_name", "config", "param_groups", "registered_name"}


def _constructor(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The keyword parameters of ``cls(params, ...)`` and whether it takes ``**kwargs``."""
    params = dict(list(inspect.signature(cls).parameters.items())[1:])  # drop ``params``
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {n: p for n, p in params.items() if p.kind is not p.VAR_KEYWORD}, var_kw


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    return type(a) is type(b) and a == b


def optimizer_config(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The class and hyperparameters of ``optimizer`` (see the module docstring).

    Raises ``ValueError`` for an optimizer that cannot be rebuilt from them (its
    constructor needs an argument that is not one of its hyperparameters).
    """
    cls = type(optimizer)
    accepted, var_kw = _constructor(cls)
    names = [n for n in optimizer.defaults if n != "params"]
    missing = [
        n for n, p in accepted.items() if p.default is inspect.Parameter.empty and n not in names
    ]
    if missing:
        raise ValueError(
            f"{cls.__name__} cannot be rebuilt from its hyperparameters: its constructor needs "
            f"{missing}, which are not in its defaults; put the optimizer itself in the config "
            "(config['inner_optimizer'] = optimizer) before from_config"
        )
    groups = optimizer.param_groups
    config: dict[str, Any] = {}
    for name in names:
        if not (var_kw or name in accepted):
            continue  # fixed by the class (AdamW's decoupled_weight_decay)
        values = [g[name] for g in groups]
        shared = all(_same(v, values[0]) for v in values)
        config[name] = values[0] if shared else optimizer.defaults[name]
    built = {n: config.get(n, optimizer.defaults[n]) for n in names}
    overrides = [{n: g[n] for n in names if not _same(g[n], built[n])} for g in groups]
    result = {"module": cls.__module__, "class_name": cls.__name__, "config": config}
    if any(overrides):
        result["param_groups"] = overrides
    return result


def _resolve(config: Mapping[str, Any], custom_objects: Mapping[str, Any] | None) -> type:
    name, module = config["class_name"], config.get("module", "")
    registered = config.get("registered_name")
    if registered is not None and not isinstance(registered, str):
        raise TypeError(
            f"the optimizer config's registered_name must be a str or None, got {registered!r}"
        )
    custom = custom_objects or {}
    # As Keras looks a class up: by its registered name first, then by its class name.
    cls = custom.get(registered) if registered else None
    if cls is None:
        cls = custom.get(name)
    if cls is None and str(module).startswith("torch.optim"):
        cls = getattr(torch.optim, name, None)
    if cls is None and str(module).split(".", 1)[0] in ("keras", "tf_keras", "tensorflow"):
        # Its hyperparameters have Keras's names and meanings (learning_rate; Adam's epsilon
        # added before the bias correction): no torch optimizer takes them as they are.
        raise ValueError(
            f"the inner optimizer's config is a Keras optimizer's ({module}.{name}); mixprec "
            "wraps torch optimizers: build the torch one (e.g. torch.optim.SGD(params, "
            "lr=...)) and put it in the config as config['inner_optimizer']"
        )
    if cls is None:
        key = registered or name
        raise ValueError(
            f"unknown optimizer class {name!r} (module {module!r}); pass "
            f"custom_objects={{{key!r}: {name}}} to from_config"
        )
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{name!r} resolves to {cls!r}, not a torch.optim.Optimizer subclass")
    return cls


def _restore_tuples(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    # A JSON round trip turns tuples (Adam's betas) into lists; the constructor's own
    # default says which they were.
    accepted, _ = _constructor(cls)
    out = dict(values)
    for name, value in values.items():
        param = accepted.get(name)
        if isinstance(value, list) and param is not None and isinstance(param.default, tuple):
            out[name] = tuple(value)
    return out


def _groups(params: Any, saved: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``params`` as torch's param-group dicts, with the saved per-group overrides."""
    if isinstance(params, torch.Tensor):
        params = [params]
    if not isinstance(params, Iterable):
        raise TypeError(
            f"params must be an iterable of tensors or of param-group dicts, got "
            f"{type(params).__name__}; e.g. params=model.parameters()"
        )
    items = list(params)
    if items and all(isinstance(item, Mapping) for item in items):
        groups = [dict(item) for item in items]
    elif all(isinstance(item, torch.Tensor) for item in items):
        groups = [{"params": items}]
    else:
        raise TypeError("params must hold either tensors or param-group dicts, not a mix")
    if saved and len(saved) != len(groups):
        raise ValueError(
            f"the config was saved from an optimizer with {len(saved)} parameter groups, but "
            f"params gives {len(groups)}; pass a list of {len(saved)} param-group dicts "
            "(e.g. [{'params': encoder.parameters()}, {'params': head.parameters()}])"
        )
    for group, override in zip(groups, saved):
        for name, value in override.items():
            group.setdefault(name, value)  # a value given with the params wins
    return groups


def optimizer_from_config(
    config: Mapping[str, Any],
    params: Any,
    custom_objects: Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Rebuild the optimizer that :func:`optimizer_config` described, over ``params``."""
    if not isinstance(config, Mapping) or not {"class_name", "config"} <= set(config):
        raise ValueError(
            f"an optimizer config is a dict with keys 'class_name' and 'config' (and "
            f"optionally 'module', 'param_groups', 'registered_name'), got {config!r}"
        )
    unknown = set(config) - _KEYS
    if unknown:
        raise ValueError(f"optimizer config has unknown keys {sorted(unknown)}")
    if params is None:
        raise ValueError(
            "from_config needs the parameters to optimize: a config holds hyperparameters, "
            "not tensors; call from_config(config, params=model.parameters())"
        )
    cls = _resolve(config, custom_objects)
    saved = [_restore_tuples(cls, g) for g in config.get("param_groups") or []]
    groups = _groups(params, saved)
    return cls(groups, **_restore_tuples(cls, config["config"]))
