"""The checkpoint of a ``LossScaleOptimizer``: torch's shape, plus mixprec's own entry.

``state_dict()`` is the inner optimizer's state dict (``state`` and ``param_groups``
at the top, so every tool that reads optimizer state works) with one more key,
``"mixprec"``: the loss scale's kind, configuration and state, the step counters
and the optional parts (master weights, EMA, gradient accumulation). Everything in
it is a tensor, number, string, ``None``, list or dict, so ``torch.load(...,
weights_only=True)`` reads it.

Loading checks everything before it changes anything. The saved loss-scale
configuration is applied (as ``torch.amp.GradScaler.load_state_dict`` applies its
growth settings); a checkpoint of another kind of loss scale is a ``ValueError``.
A state dict with only ``state`` and ``param_groups`` (what
``torch.distributed.checkpoint.state_dict.set_state_dict`` passes) loads the inner
optimizer and keeps the wrapper's own state. The layout of mixprec 0.1.0 (keys
``inner``, ``loss_scale``, ``counters``, ...) still loads.
"""

from __future__ import annotations

from typing import Any

from mixprec.optim.counters import StepCounters

__all__ = ["optimizer_state", "load_state"]

_EXTRA = "mixprec"
_PARTS = (("master", "_master"), ("ema", "_ema"), ("accumulation", "_accumulator"))
_OWN_KEYS = {"loss_scale", "counters", *(key for key, _ in _PARTS)}
_OLD_KEYS = {"inner", *_OWN_KEYS}


def optimizer_state(opt: Any) -> dict[str, Any]:
    """The state dict of the ``LossScaleOptimizer`` ``opt``."""
    scaler = opt.loss_scaler
    own = {
        "loss_scale": {
            "kind": type(scaler).__name__,
            "config": scaler.get_config(),
            "state": scaler.state_dict(),
        },
        "counters": opt._counters.state_dict(),
    }
    for key, attr in _PARTS:
        part = getattr(opt, attr)
        own[key] = None if part is None else part.state_dict()
    return {**opt.inner_optimizer.state_dict(), _EXTRA: own}


def _split(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the inner optimizer's state dict, mixprec's entry or ``None``)."""
    if isinstance(state_dict, dict) and set(state_dict) == _OLD_KEYS:  # mixprec 0.1.0
        own = {k: v for k, v in state_dict.items() if k != "inner"}
        return state_dict["inner"], own
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            "not an optimizer state dict: expected the keys 'state' and 'param_groups' "
            f"(and 'mixprec' from a LossScaleOptimizer), got {got}"
        )
    inner = {k: v for k, v in state_dict.items() if k != _EXTRA}
    own = state_dict.get(_EXTRA)
    if own is not None and (not isinstance(own, dict) or set(own) != _OWN_KEYS):
        got = sorted(own) if isinstance(own, dict) else type(own).__name__
        raise ValueError(f"state_dict['mixprec'] must have keys {sorted(_OWN_KEYS)}, got {got}")
    return inner, own


def _check_own(opt: Any, own: dict[str, Any]) -> Any:
    """Raise ``ValueError`` if ``own`` does not fit ``opt``; return the saved loss scale."""
    saved = own["loss_scale"]
    kind, mine = saved["kind"], type(opt.loss_scaler).__name__
    if kind != mine:
        raise ValueError(
            f"the checkpoint's loss scale is a {kind}, this optimizer's is a {mine}; "
            "build the optimizer with the same kind of loss scale"
        )
    for key, attr in _PARTS:
        part = getattr(opt, attr)
        if (own[key] is None) != (part is None):
            raise ValueError(
                f"the checkpoint was saved {'without' if own[key] is None else 'with'} "
                f"{key} but this optimizer is configured {'with' if part else 'without'} it"
            )
    StepCounters.check_state(own["counters"])
    # Builds (and so validates) the saved configuration before anything changes.
    return type(opt.loss_scaler).from_config(saved["config"])


def load_state(opt: Any, state_dict: Any) -> None:
    """Restore :func:`optimizer_state`'s output into ``opt``; see the module docstring."""
    inner, own = _split(state_dict)
    configured = None if own is None else _check_own(opt, own)
    opt.inner_optimizer.load_state_dict(inner)
    if own is None:
        return
    scaler = opt.loss_scaler
    # Apply the saved configuration in place: the object may be shared by optimizers.
    for f in type(scaler)._config_fields():
        setattr(scaler, f.name, getattr(configured, f.name))
    scaler.load_state_dict(own["loss_scale"]["state"])
    opt._counters.load_state_dict(own["counters"])
    for key, attr in _PARTS:
        part = getattr(opt, attr)
        if part is not None:
            part.load_state_dict(own[key])
