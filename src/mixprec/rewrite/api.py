"""The rewrite's entry points: ``rewrite`` and ``enable_mixed_precision_graph_rewrite``.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
>>> fast, opt = enable_mixed_precision_graph_rewrite(
...     net, opt, dtype=torch.bfloat16, example_inputs=(torch.randn(2, 8),))
>>> loss = fast(torch.randn(5, 8)).square().mean()
>>> opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()
>>> fast(torch.randn(3, 8)).dtype, net[0].weight.dtype
(torch.float32, torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from mixprec._api_guard import claim_model, model_api
from mixprec.rewrite.capture import capture
from mixprec.rewrite.casts import apply_plan
from mixprec.rewrite.lists import AmpLists, check_level
from mixprec.rewrite.paint import paint
from mixprec.rewrite.plan import minimize_casts

__all__ = ["enable_mixed_precision_graph_rewrite", "rewrite"]

_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _check_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, (torch.dtype, str)):
        raise ValueError(
            f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}; the model itself "
            "stays float32 and the rewrite picks which ops run in dtype"
        )
    raise TypeError(
        f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r} ({type(dtype).__name__})"
    )


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in "
            "an nn.Module whose forward calls it"
        )
    if model_api(model) is not None:
        claim_model(model, "rewrite")  # raises: another API, or a second rewrite
    for name, module in model.named_modules():
        if name and model_api(module) is not None:
            raise ValueError(
                f"submodule {name!r} already uses the mixprec {model_api(module)!r} API; only "
                "one mixed-precision API can be used on a model: start from the float32 model"
            )
    for name, param in model.named_parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"model parameter {name!r} is {param.dtype}; the graph rewrite starts from a "
                "float32 model and keeps float32 master weights: call model.float() first"
            )


def rewrite(
    model: nn.Module,
    example_inputs: Any,
    dtype: torch.dtype = torch.float16,
    lists: AmpLists | None = None,
    level: str = "default",
    keep_output_dtype: bool = False,
) -> fx.GraphModule:
    """Return ``model`` as a graph whose chosen ops run in ``dtype``, with casts inside.

    Algorithm::

        gm = capture(model, example_inputs)            # torch.export, else fx; see capture.py
        lists = (lists or AmpLists()).with_env()       # MIXPREC_*LIST_{ADD,REMOVE}
        painting = paint(gm.graph, lists, dtype, level) # allow / deny / infer / clear; paint.py
        plan = minimize_casts(painting)                # one cast per value and dtype; plan.py
        apply the plan: casts, bias adds, dtype arguments, cancelling casts  # casts.py
        mark model and gm as rewritten (a second rewrite is an error)

    The result holds the model's own float32 ``Parameter`` objects (the casts to
    ``dtype`` happen in the graph, on each parameter's edge into a low-precision
    op), so gradients reach them and an optimizer built on ``model.parameters()``
    trains it. It accepts other batch sizes than the example's (the first
    dimension of every example tensor is dynamic), follows ``.train()`` /
    ``.eval()`` for dropout, batch norm and attention dropout, and returns float32
    outputs unless ``keep_output_dtype=True``. :func:`mixprec.rewrite.explain`
    reports every decision.

    Args:
        model: a float32 ``nn.Module``.
        example_inputs: the positional arguments of one forward call (a tensor or a
            tuple); use a batch of 2 or more so that the batch size stays free.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        lists: the op lists (default :class:`AmpLists`), before environment overrides.
        level: ``"default"``, ``"treat_infer_as_deny"``, ``"allow_only"`` or
            ``"unsafe_force_all"`` (see ``mixprec.rewrite.LEVELS``).
        keep_output_dtype: return outputs in the dtype of the op that made them.

    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> gm = rewrite(net, torch.randn(2, 4), dtype=torch.bfloat16)
    >>> [(n.meta["mixprec"]["op"], n.meta["mixprec"]["colour"])
    ...  for n in gm.graph.nodes if n.meta.get("mixprec", {}).get("role") == "op"]
    [('linear', 'bfloat16'), ('softmax', 'float32')]
    """
    _check_model(model)
    low = _check_dtype(dtype)
    if lists is None:
        lists = AmpLists()
    if not isinstance(lists, AmpLists):
        raise TypeError(
            f"lists must be a mixprec.rewrite.AmpLists or None, got {type(lists).__name__}; "
            "build one with AmpLists(allow=..., deny=...) or edit AmpLists().add(...)"
        )
    if not isinstance(level, str):
        raise TypeError(f"level must be a string, got {level!r} ({type(level).__name__})")
    check_level(level)
    if not isinstance(keep_output_dtype, bool):
        raise TypeError(f"keep_output_dtype must be True or False, got {keep_output_dtype!r}")
    effective = lists.with_env()

    captured = capture(model, example_inputs)
    gm = captured.module
    painting = paint(gm.graph, effective, low, level, root=gm)
    plan, saved = minimize_casts(painting, keep_output_dtype)
    apply_plan(gm, painting, plan, saved)
    gm.meta["mixprec"] = {
        "dtype": str(low).replace("torch.", ""),
        "level": level,
        "method": captured.method,
        "export_error": captured.export_error,
        "keep_output_dtype": keep_output_dtype,
    }
    # Every submodule is marked, so that the amp API refuses any part of the model.
    for module in model.modules():
        claim_model(module, "rewrite")
    claim_model(gm, "rewrite")
    gm.train(model.training)
    return gm


def _build_optimizer(optimizer: Any, loss_scale: Any) -> Any:
    # Imported here: the optimizer layer sits beside the rewrite, not under it.
    from mixprec.loss_scale import LossScale, loss_scale_from_spec
    from mixprec.optim import LossScaleOptimizer

    if isinstance(optimizer, LossScaleOptimizer):
        raise ValueError(
            "optimizer is already a LossScaleOptimizer; pass the plain optimizer, which "
            "enable_mixed_precision_graph_rewrite wraps with loss scaling"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float, str, LossScale)):
        raise TypeError(
            f"loss_scale must be 'dynamic', a positive number or a mixprec.loss_scale."
            f"LossScale, got {loss_scale!r} ({type(loss_scale).__name__})"
        )
    return LossScaleOptimizer(optimizer, loss_scale=loss_scale_from_spec(loss_scale))


def _check_no_global_policy() -> None:
    # As in TensorFlow: a mixed global policy means the policy API is in use, and
    # the two APIs would cast against each other.
    from mixprec.policy import global_policy

    policy = global_policy()
    if policy.compute_dtype != torch.float32 or policy.param_dtype != torch.float32:
        raise ValueError(
            f"the mixed-precision policy API is in use (global policy {str(policy)!r}); only "
            "one mixed-precision API can be used: call mixprec.policy.set_global_policy(None) "
            "(or leave the policy_scope) before enable_mixed_precision_graph_rewrite"
        )


def enable_mixed_precision_graph_rewrite(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_scale: Any = "dynamic",
    dtype: torch.dtype = torch.float16,
    *,
    example_inputs: Any,
    lists: AmpLists | None = None,
    level: str = "default",
) -> tuple[fx.GraphModule, Any]:
    """Rewrite ``model`` for mixed precision and wrap ``optimizer`` with loss scaling.

    PyTorch's form of TensorFlow's ``enable_mixed_precision_graph_rewrite``: the
    model is rewritten with :func:`rewrite` (``example_inputs``, a required keyword,
    are the positional arguments of one forward call: the graph is captured from
    them) and the optimizer is wrapped in a ``mixprec.optim.LossScaleOptimizer``.
    Use the returned pair in place of the originals::

        loss = loss_fn(rewritten(x), y)
        opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()

    ``loss_scale`` is ``"dynamic"`` (the default: grows after runs of finite
    steps, backs off and skips the step on overflow), a number (a static scale) or
    a ``mixprec.loss_scale.LossScale`` object.

    Algorithm::

        refuse a mixed global policy (mixprec.policy): one mixed-precision API only
        check optimizer and loss_scale; wrap: LossScaleOptimizer(optimizer, loss_scale)
        rewritten = rewrite(model, example_inputs, dtype, lists, level)  # claims model
        return rewritten, wrapped

    Raises ``ValueError`` when the model already went through another mixprec API
    (``amp.initialize``, a policy), when a mixed global policy is set, or when the
    model went through this rewrite, when ``optimizer`` is
    already a ``LossScaleOptimizer``, or when it holds none of the model's parameters.
    A rejected call changes neither the model nor the optimizer.

    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = enable_mixed_precision_graph_rewrite(
    ...     net, torch.optim.SGD(net.parameters(), lr=0.1), loss_scale=128,
    ...     example_inputs=torch.randn(2, 4))
    >>> type(opt).__name__, type(opt.loss_scaler).__name__, model(torch.ones(3, 4)).dtype
    ('LossScaleOptimizer', 'StaticLossScale', torch.float32)
    """
    _check_no_global_policy()
    wrapped = _build_optimizer(optimizer, loss_scale)
    if isinstance(model, nn.Module):
        own = {id(p) for p in model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if held and not any(id(p) in own for p in held):
            raise ValueError(
                "optimizer holds none of model's parameters; build it on model.parameters() "
                "(the rewritten model trains the same Parameter objects)"
            )
    rewritten = rewrite(model, example_inputs, dtype=dtype, lists=lists, level=level)
    return rewritten, wrapped
