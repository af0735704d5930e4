"""The rewrite's entry point: ``rewrite(model, example_inputs=None, dtype)``.

>>> import torch
>>> from mixprec import LossScaleOptimizer
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
>>> opt = LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
>>> fast = rewrite(net, (torch.randn(2, 8),), dtype=torch.bfloat16)
>>> loss = fast(torch.randn(5, 8)).square().mean()
>>> opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()
>>> fast(torch.randn(3, 8)).dtype, net[0].weight.dtype
(torch.float32, torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from mixprec._checks import as_low_precision, check_bool, check_number
from mixprec.amp._claim import claim_model, model_api
from mixprec.rewrite._capture import capture
from mixprec.rewrite._casts import apply_plan
from mixprec.rewrite._lazy import DEFAULT_MAX_CAPTURES, LazyRewrite
from mixprec.rewrite._lists import AmpLists, check_level
from mixprec.rewrite._outputs import attach_output_structure
from mixprec.rewrite._paint import paint
from mixprec.rewrite._plan import minimize_casts


def _check_dtype(dtype: Any) -> torch.dtype:
    return as_low_precision(
        dtype, "dtype", hint="the model itself stays float32 and the rewrite picks which ops "
        "run in dtype",
    )  # fmt: skip


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
    _check_float32(model)


def _check_float32(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"model parameter {name!r} is {param.dtype}; the graph rewrite starts from a "
                "float32 model and keeps float32 master weights: call model.float() first"
            )


def _rewrite_graph(
    model: nn.Module,
    args: Any,
    low: torch.dtype,
    lists: AmpLists,
    level: str,
    keep_output_dtype: bool,
    training: bool = True,
    lazy: bool = False,
) -> tuple[fx.GraphModule, str]:
    """Capture ``model`` on ``args`` and rewrite the graph; returns it and how it was captured."""
    captured = capture(model, args, training=training, warn_batch=not lazy)
    gm = captured.module
    painting = paint(gm.graph, lists, low, level, root=gm)
    plan, saved = minimize_casts(painting, keep_output_dtype)
    apply_plan(gm, painting, plan, saved)
    if captured.structure is not None:  # rebuilt after the casts: its tensors are the outputs
        attach_output_structure(gm, captured.structure)
    gm.meta["mixprec"] = {
        "dtype": str(low).replace("torch.", ""),
        "level": level,
        "method": captured.method,
        "export_error": captured.export_error,
        "keep_output_dtype": keep_output_dtype,
    }
    claim_model(gm, "rewrite")
    gm.train(training)
    return gm, captured.method


def rewrite(
    model: nn.Module,
    example_inputs: Any = None,
    dtype: torch.dtype = torch.float16,
    lists: AmpLists | None = None,
    level: str = "default",
    keep_output_dtype: bool = False,
    *,
    max_captures: int | None = None,
) -> fx.GraphModule | LazyRewrite:
    """Return ``model`` as a graph whose chosen ops run in ``dtype``, with casts inside.

    With ``example_inputs`` the model is captured now and a ``torch.fx.GraphModule``
    comes back. Without them a :class:`~mixprec.rewrite._lazy.LazyRewrite` comes back,
    which captures on its first call and again when the inputs' shapes, dtypes or
    devices or the train/eval mode change (as ``torch.compile`` compiles, and as the
    classic graph rewrite ran when a graph first ran); after ``max_captures`` graphs (default
    8) a call that fits none raises :class:`~mixprec.rewrite._lazy.RecaptureLimitError`.

    Algorithm::

        gm = capture(model, example_inputs)            # torch.export, else fx; see capture.py
        lists = (lists or AmpLists()).with_env()       # MIXPREC_*LIST_{ADD,REMOVE}
        painting = paint(gm.graph, lists, dtype, level) # allow / deny / infer / clear; paint.py
        plan = minimize_casts(painting)                # one cast per value and dtype; plan.py
        apply the plan: casts, bias adds, dtype arguments, cancelling casts  # casts.py
        outputs export cannot return (cache objects, dataclasses) rebuilt at the end  # outputs.py
        mark model and gm as rewritten (a second rewrite is an error)

    The result holds the model's own float32 ``Parameter`` objects (the casts to
    ``dtype`` happen in the graph, on each parameter's edge into a low-precision
    op), so gradients reach them and an optimizer built on ``model.parameters()``
    trains it. It accepts other batch sizes than the example's (the first
    dimension of every example tensor is dynamic), follows ``.train()`` /
    ``.eval()`` for dropout (recurrent included), batch norm and attention dropout, and returns float32
    outputs unless ``keep_output_dtype=True``. Outputs come back as
    the model gives them: tensors in tuples, lists, dicts, ``ModelOutput`` objects,
    dataclasses and plain objects such as a Hugging Face ``DynamicCache`` (rebuilt, fresh,
    on every call). :func:`mixprec.rewrite.explain` reports every decision. A model
    that cannot be captured raises :class:`~mixprec.rewrite.CaptureError` naming the
    cause (data-dependent control flow, an output that cannot be rebuilt) and the fix.

    Args:
        model: a float32 ``nn.Module``.
        example_inputs: the positional arguments of one forward call (a tensor or a
            tuple); use a batch of 2 or more so that the batch size stays free.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        lists: the op lists (default :class:`AmpLists`), before environment overrides.
        level: ``"default"``, ``"treat_infer_as_deny"``, ``"allow_only"`` or
            ``"unsafe_force_all"`` (see ``mixprec.rewrite.PAINT_LEVELS``).
        keep_output_dtype: return outputs in the dtype of the op that made them.
        max_captures: for a lazy rewrite (no ``example_inputs``), how many graphs it may
            capture before refusing a call that fits none of them.

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
    check_bool("keep_output_dtype", keep_output_dtype)
    if max_captures is not None:
        if example_inputs is not None:
            raise ValueError(
                "max_captures applies to a lazy rewrite, which captures on each new kind of "
                "call; with example_inputs= the model is captured once: drop max_captures"
            )
        check_number("max_captures", max_captures, integer=True, minimum=1)
    effective = lists.with_env()

    if example_inputs is None:

        def build(
            module: nn.Module, args: tuple[Any, ...], training: bool
        ) -> tuple[fx.GraphModule, str]:
            _check_float32(module)  # .half() after rewrite() is caught at the next capture
            return _rewrite_graph(
                module, args, low, effective, level, keep_output_dtype, training, lazy=True
            )

        result: fx.GraphModule | LazyRewrite = LazyRewrite(
            model, build, DEFAULT_MAX_CAPTURES if max_captures is None else max_captures
        )
    else:
        result, _ = _rewrite_graph(model, example_inputs, low, effective, level, keep_output_dtype)
        result.train(model.training)
    # Every submodule is marked, so that the amp API refuses any part of the model.
    for module in model.modules():
        claim_model(module, "rewrite")
    if isinstance(result, LazyRewrite):
        claim_model(result, "rewrite")  # a captured graph is claimed when it is made
    return result
