"""``tf.train.experimental.enable_mixed_precision_graph_rewrite`` over :func:`mixprec.rewrite.rewrite`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec import loss_scale as core
from mixprec._checks import check_instance, check_number
from mixprec.compat.tf._optimizer import LossScaleOptimizer
from mixprec.optim import LossScaleOptimizer as _CoreLossScaleOptimizer
from mixprec.policy import global_policy


def _check_no_mixed_policy() -> None:
    # As in TensorFlow: a mixed global policy means the policy API is in use, and
    # the two APIs would cast against each other.
    policy = global_policy()
    if policy.compute_dtype != torch.float32 or policy.param_dtype != torch.float32:
        raise ValueError(
            f"the mixed-precision policy API is in use (global policy {str(policy)!r}); only "
            "one mixed-precision API can be used: call mixprec.policy.set_global_policy(None) "
            "(or leave the policy_scope) before enable_mixed_precision_graph_rewrite"
        )


def _wrap(opt: torch.optim.Optimizer, loss_scale: Any) -> LossScaleOptimizer:
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return LossScaleOptimizer(opt)  # TF's rule and defaults
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        check_number("loss_scale", loss_scale, minimum=0, exclusive=True)
        return LossScaleOptimizer(opt, dynamic=False, initial_scale=float(loss_scale))
    if isinstance(loss_scale, core.LossScale):
        return LossScaleOptimizer._with_loss_scale(opt, loss_scale)
    # TensorFlow raises ValueError for any loss_scale it cannot use, whatever its type.
    raise ValueError(
        f"loss_scale must be 'dynamic', a positive number or a mixprec.LossScale, got "
        f"{loss_scale!r} ({type(loss_scale).__name__})"
    )


def enable_mixed_precision_graph_rewrite(
    opt: torch.optim.Optimizer,
    loss_scale: Any = "dynamic",
    *,
    model: nn.Module | None = None,
    example_inputs: Any = None,
    dtype: torch.dtype = torch.float16,
    lists: Any = None,
    level: str = "default",
    max_captures: int | None = None,
) -> Any:
    """``tf.train.experimental.enable_mixed_precision_graph_rewrite(opt, loss_scale)``.

    Wraps ``opt`` in a :class:`LossScaleOptimizer` with ``loss_scale``: ``"dynamic"``
    (the default), an int/float (a fixed scale) or a loss-scale object. TF rewrote
    every graph when it first ran; in PyTorch the graph comes from a model, so pass
    ``model=`` to get ``(rewritten_model, optimizer)`` from :func:`mixprec.rewrite.rewrite`
    (``dtype``, ``lists``, ``level`` and ``max_captures`` go to it). The model is
    captured on its first call, and again when the inputs or the train/eval mode
    change, as TF's graph rewrite ran inside each ``tf.function`` trace;
    ``example_inputs=`` (the positional arguments of one forward call) captures it at
    once. Without ``model`` the wrapped optimizer alone is returned, as TF returns it.

    Raises ``ValueError`` if a mixed global policy is set (only one of the two
    mixed-precision APIs can be used), if ``opt`` is already a loss-scale optimizer,
    if it holds none of ``model``'s parameters, or if the model went through another
    mixprec API. A rejected call changes neither the model nor the optimizer.

    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = enable_mixed_precision_graph_rewrite(
    ...     torch.optim.SGD(net.parameters(), lr=0.1), 128, model=net)
    >>> type(opt.loss_scaler).__name__, model(torch.ones(3, 4)).dtype, model.captures
    ('FixedLossScale', torch.float32, 1)
    """
    check_instance("opt", opt, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if isinstance(opt, _CoreLossScaleOptimizer):
        raise ValueError(
            "opt is already a LossScaleOptimizer; pass the plain optimizer, which "
            "enable_mixed_precision_graph_rewrite wraps with loss scaling"
        )
    _check_no_mixed_policy()
    if model is None and (example_inputs is not None or max_captures is not None):
        raise ValueError(
            "example_inputs / max_captures were given without model=; they say how to "
            "capture the model: pass model= too, or neither"
        )
    if isinstance(model, nn.Module):
        own = {id(p) for p in model.parameters()}
        held = [p for group in opt.param_groups for p in group["params"]]
        if held and not any(id(p) in own for p in held):
            raise ValueError(
                "opt holds none of model's parameters; build it on model.parameters() "
                "(the rewritten model trains the same Parameter objects)"
            )
    wrapped = _wrap(opt, loss_scale)
    if model is None:
        return wrapped
    from mixprec.rewrite import rewrite

    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    rewritten = rewrite(
        model, example_inputs, dtype=dtype, lists=lists, level=level, max_captures=max_captures
    )
    return rewritten, wrapped
