"""``amp.initialize``: precision levels O0-O3 on module granularity.

::

    level  parameters stored      computes in low precision          loss scale     masters
    O0     float32                nothing                            none           no
    O1     float32, cast on the   allow-listed modules and functions  dynamic (fp16)  no
           fly (cached per step)  (linear, conv*, matmul/bmm, RNNs,   none (bf16)
                                  prelu, MultiheadAttention); their
                                  outputs stay low, deny-listed ops
                                  (norms, softmax, losses) cast up
    O2     low; norms float32     everything but the deny list        dynamic         float32, in
                                  (BatchNorm, LayerNorm, GroupNorm..)                  the optimizer
    O3     low, norms too         everything                          none           no
    lean   O3 in bfloat16 (or float16), every update Kahan-compensated: none     no (2 B/param
           compensation buffer, ``master_weights="kahan"``; float32-like updates at 8
           bytes per parameter with AdamW against O2's 14, see master_weights)
    auto   by the hardware (see choose_auto): CUDA O2, bfloat16 at compute capability
           >= 8.0, else float16 with a dynamic loss scale; a CPU with bfloat16 units O1
           bfloat16; any other CPU O0 (float32)

At every level the model's floating inputs are cast to its compute dtype on entry
and its floating outputs to float32, so the loss is computed in float32. bfloat16
has float32's exponent range, so its gradients do not underflow: O1 and O3 do not
scale a bfloat16 loss by default, O2 keeps its dynamic scale (harmless, and it still
skips a step whose gradients overflow).

O3 steps low-precision parameters directly, so Adam's moments are float16 too. An
``eps`` below float16's smallest normal number (6.1e-05), like Adam's default 1e-8,
rounds to (almost) zero there and the first applied step turns every weight NaN or inf.
:func:`initialize` refuses that up front (``ValueError`` naming the group and ``eps``)
rather than keeping the state in float32 behind the optimizer's back, which is what
O2's master weights are for. Use ``eps >= 1e-4``, bfloat16, SGD, or O2.

``nn.MultiheadAttention`` feeds raw Parameters to ``F.multi_head_attention_forward``
instead of calling ``nn.Linear`` modules, so O1 lists the module type itself: its
inputs and all its parameters (``out_proj`` included) are cast on entry, and every
matmul inside runs low. ``nn.TransformerEncoderLayer`` works at every level in
training and evaluation: its fused inference fast path declines modules with
hooks and runs the regular layers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from mixprec._checks import check_bool, check_choice
from mixprec.amp.auto import choose_auto, cpu_has_fast, resolve_level
from mixprec.amp.cast_hooks import FunctionLists, get_state
from mixprec.amp.level_plan import low_params, plan_level
from mixprec.amp.lists import check_list, get_black_list, get_white_list, split_list
from mixprec.amp.module_policy import apply_policies, check_module, claim_tree
from mixprec.dtypes import as_low_precision
from mixprec.float8 import convert_to_float8
from mixprec.float8.scaling import RECIPES as FLOAT8_RECIPES
from mixprec.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, loss_scale_from_spec
from mixprec.optim import LossScaleOptimizer
from mixprec.optim._masters import master_weight_mode

__all__ = [
    "initialize",
    "LEVELS",
    "check_fp8",
    "check_level_name",
    "default_loss_scale",
    "level_master_weights",
    "resolve_level",
    "choose_auto",
    "cpu_has_fast",
]

_log = logging.getLogger("mixprec.amp")

#: The level names :func:`initialize` accepts.
LEVELS = ("O0", "O1", "O2", "O3", "lean", "auto")


def check_level_name(level: Any) -> str:
    """``level`` checked and normalised (``"o2"`` -> ``"O2"``); a clear error otherwise."""
    if not isinstance(level, str):
        raise TypeError(
            f"level must be a str, one of {LEVELS}, got {type(level).__name__} {level!r}"
        )
    word = level.strip().lower()
    normal = word if word in ("auto", "lean") else level.strip().upper()
    if normal not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    return normal


def _check_dtype(dtype: Any) -> torch.dtype:
    return as_low_precision(
        dtype, "dtype", hint="the low precision of the level; use level='O0' for float32"
    )


def _check_optimizer_eps(optimizer: torch.optim.Optimizer, low: set[int]) -> None:
    """Refuse an ``eps`` that float16 optimizer state cannot hold (see the module)."""
    floor = torch.finfo(torch.float16).tiny
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps >= floor:
            continue
        if any(id(p) in low for p in group["params"]):
            raise ValueError(
                f"optimizer param group {i} has eps={eps:g}, below float16's smallest normal "
                f"number {floor:.3g}: O3 keeps {type(optimizer).__name__}'s state in float16, "
                "where it rounds to ~0 and the first applied step makes the weights NaN/inf; "
                "pass eps>=1e-4, use bfloat16, or O2 (float32 masters and optimizer state)"
            )


def default_loss_scale(level: str, dtype: torch.dtype) -> LossScale:
    """The loss scale :func:`initialize` gives ``level`` in ``dtype`` when none is passed.

    >>> type(default_loss_scale("O2", torch.bfloat16)).__name__
    'DynamicLossScale'
    """
    # O2 is dynamic for both dtypes (the classic O2): with bfloat16 it never backs
    # off on finite gradients and costs nothing more than the finite check every
    # level runs anyway. O1 scales only float16, whose gradients can underflow.
    if level == "O2" or (level == "O1" and dtype == torch.float16):
        return DynamicLossScale()
    return NoOpLossScale()


def _check_loss_scale(loss_scale: Any, level: str, dtype: torch.dtype) -> LossScale:
    if loss_scale is None:
        return default_loss_scale(level, dtype)
    try:
        return loss_scale_from_spec(loss_scale)
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"{err}; loss_scale=None picks the level's default (dynamic for float16 O1/O2)"
        ) from None


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    level: str = "O1",
    dtype: torch.dtype = torch.float16,
    keep_batchnorm_fp32: bool | None = None,
    loss_scale: Any = None,
    white_list: Any = None,
    black_list: Any = None,
    master_weights: Any = None,
    fp8: bool | str = False,
) -> tuple[nn.Module, Any]:
    """Prepare ``model`` (in place) and ``optimizer`` for mixed-precision training at ``level``.

    Args:
        model: a float32 ``nn.Module``. Submodules given a policy beforehand
            (:func:`set_policy`, :func:`to_float`) keep it.
        optimizer: optional ``torch.optim.Optimizer`` over the model's parameters;
            returned wrapped as :class:`mixprec.optim.LossScaleOptimizer` (``None``
            gives ``None``). Use it as ``opt.scale_loss(loss).backward(); opt.step();
            opt.zero_grad()``.
        level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"lean"`` or ``"auto"`` (table
            in :mod:`mixprec.amp.levels`).
        dtype: the low precision, ``torch.float16`` or ``torch.bfloat16``.
        keep_batchnorm_fp32: keep normalisation layers float32; default ``True`` for
            O2, ``False`` for O3; O0/O1 always keep them.
        loss_scale: ``None`` (the level's default), ``"dynamic"``, a number (static
            scale) or a :class:`mixprec.loss_scale.LossScale`.
        white_list, black_list: module types and torch functions replacing the
            defaults (:func:`get_white_list`, :func:`get_black_list`). O1 runs the
            white list low, keeping its outputs low, and the black list float32
            wherever it is; O2/O3 run the black list's modules (and any function
            passed in ``black_list``) float32 and, inside them, the white list low.
        master_weights: what the optimizer steps for the low-precision parameters of O2,
            O3 and lean (:class:`~mixprec.optim.LossScaleOptimizer`'s option): ``None``
            the level's own (O2 ``"fp32"``, lean ``"kahan"``, O3 ``False``), or
            ``"fp32"``/``True``, ``"split"``, ``"kahan"``, ``"stochastic"``, ``False``.
            ``"split"`` and ``"stochastic"`` need bfloat16. O0/O1 keep float32
            parameters, so anything but ``None``/``False`` is refused there.
        fp8: run the model's eligible ``nn.Linear`` layers in float8 (forward and both
            backward matmuls, :mod:`mixprec.float8`) at any level: ``True`` or
            ``"dynamic"`` (per-tensor scales from the current amax), ``"delayed"``
            (from an amax history, as Transformer Engine), ``False`` (default). The
            layers are swapped in place, keeping their Parameters; which ran in float8
            and why the others did not goes to the ``mixprec.amp`` logger
            (:func:`mixprec.float8.convert_to_float8` gives the same report). A model
            with no eligible layer is refused.

    ``auto`` picks level and dtype by the hardware of the model's parameters, whatever
    ``dtype`` says (:func:`choose_auto`; the choice and why go to the ``mixprec.amp``
    logger). CUDA: O2 (tensor cores; O2 halves weight and activation memory). A CPU with
    bfloat16 units: O1 in bfloat16, which keeps float32 parameters and numerics
    everywhere but the matmuls the units speed up, and needs no master-weight memory.
    Measured on an AVX512-BF16 CPU, a transformer encoder's training step took
    0.38-0.40 of float32's time with O1 against 0.36-0.37 with O2 (``torch.autocast``:
    0.35-0.36): O2's few percent do not pay for its weaker numerics there. O3 in
    float16 with an ``eps`` below float16's range (Adam's 1e-8) is refused (module doc).

    Algorithm::

        validate every argument                      # a rejected call changes nothing
        plan <- owners and policies for the level    # see level_plan.plan_level
        store each region's parameters in its param dtype (in place, same Parameters)
        fp8: swap eligible nn.Linear layers for Float8Linear (same Parameters)
        install the hooks (mixprec.amp.cast_hooks); O1: function-cast mode on the root
        optimizer -> LossScaleOptimizer(optimizer, loss_scale, master_weights)

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    >>> net, opt = initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", torch.bfloat16)
    >>> net[0].weight.dtype, net[1].weight.dtype, net(torch.randn(3, 4)).dtype
    (torch.bfloat16, torch.float32, torch.float32)
    >>> opt.param_groups[0]["params"][0].dtype      # the float32 master of net[0].weight
    torch.float32
    """
    check_module("model", model)
    level = check_level_name(level)
    dtype = _check_dtype(dtype)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, LossScaleOptimizer):
        raise ValueError(
            "optimizer is already a LossScaleOptimizer; pass the plain optimizer, "
            "initialize wraps it for the level"
        )
    if keep_batchnorm_fp32 is not None:
        check_bool("keep_batchnorm_fp32", keep_batchnorm_fp32, hint="or None for the default")
    white = check_list("white_list", white_list)
    black = check_list("black_list", black_list)
    level, dtype = resolve_level(model, level, dtype)
    masters = _check_master_weights(master_weights, level, dtype, optimizer)
    fp8_recipe = check_fp8(fp8)
    lean = level == "lean"
    level = "O3" if lean else level  # lean is O3's casts with compensated updates
    if level in ("O0", "O1") and keep_batchnorm_fp32 is False:
        raise ValueError(
            f"keep_batchnorm_fp32=False with level={level!r}: {level} keeps every normalisation "
            "layer float32; use O3 for low-precision normalisation"
        )
    if level == "O0" and (white is not None or black is not None):
        raise ValueError("O0 runs everything in float32: white_list/black_list must be None")
    if black is not None and keep_batchnorm_fp32 is not None:
        raise ValueError(
            f"pass black_list or keep_batchnorm_fp32, not both (got keep_batchnorm_fp32="
            f"{keep_batchnorm_fp32!r}): black_list replaces the default normalisation list"
        )
    if white is not None and black is not None:
        both = set(white) & set(black)
        if both:
            raise ValueError(f"white_list and black_list share {sorted(map(repr, both))}")
    if state := get_state(model):
        if state.policy is not None:
            raise ValueError(
                f"model already has a policy ({state.policy}"
                f"{', level ' + state.level if state.level else ''}); initialize a fresh float32 "
                "model once, and give submodules (not the model) their own policies beforehand"
            )
    if loss_scale is not None and optimizer is None:
        raise ValueError(
            f"loss_scale={loss_scale!r} needs an optimizer to apply it to; pass optimizer="
        )
    scaler = _check_loss_scale(loss_scale, level, dtype) if optimizer is not None else None

    if level == "O1":
        white = tuple(get_white_list()) if white is None else white
        black = tuple(get_black_list()) if black is None else black
    elif level in ("O2", "O3"):
        keep = keep_batchnorm_fp32 if keep_batchnorm_fp32 is not None else level == "O2"
        # The default functions are O1's: at O2/O3 the whole model computes low by design.
        default = tuple(item for item in get_black_list() if isinstance(item, type))
        black = (default if keep else ()) if black is None else black
        white = () if white is None else white
    else:
        white = black = ()
    white_modules, white_functions = split_list(white)
    black_modules, black_functions = split_list(black)
    plan = plan_level(model, level, dtype, white_modules, black_modules)
    if optimizer is not None and masters:
        low = low_params(model, plan)
        if not any(id(p) in low for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                f"master_weights={masters!r} ({'lean' if lean else level}) acts on the "
                "parameters stored in low precision, but the optimizer holds none of them "
                "(all are outside the model or in float32 layers); build the optimizer from "
                "model.parameters()"
            )
    if optimizer is not None and level == "O3" and dtype == torch.float16:
        _check_optimizer_eps(optimizer, low_params(model, plan))
    if fp8_recipe:
        report = convert_to_float8(model, fp8_recipe)
        if not report.converted:  # nothing was swapped: the model is as it was
            raise ValueError(
                f"fp8={fp8!r}: no linear layer of the model can run in float8\n{report}"
            )
        _log.info("%s", report)
        plan = plan_level(model, level, dtype, white_modules, black_modules)  # the new layers

    claim_tree(model)
    apply_policies(plan)
    root = get_state(model)
    root.level = "lean" if lean else level
    if white_functions or black_functions:
        root.functions = FunctionLists(
            white_functions, black_functions, dtype, keep_outputs=level == "O1"
        )
    if optimizer is None:
        return model, None
    return model, LossScaleOptimizer(optimizer, loss_scale=scaler, master_weights=masters)


def check_fp8(fp8: Any) -> str | None:
    """The float8 recipe ``fp8`` asks for (``True`` is ``"dynamic"``), or ``None`` for none.

    >>> check_fp8(True), check_fp8("delayed"), check_fp8(False)
    ('dynamic', 'delayed', None)
    """
    if fp8 is False or fp8 is None:
        return None
    if fp8 is True:
        return "dynamic"
    if not isinstance(fp8, str):
        raise TypeError(f"fp8 must be a bool or a recipe name, got {type(fp8).__name__} {fp8!r}")
    return check_choice("fp8", fp8, tuple(FLOAT8_RECIPES), hint="or True for 'dynamic'")


def level_master_weights(level: str) -> str | bool:
    """The ``master_weights`` mode ``level`` uses by default.

    >>> level_master_weights("O2"), level_master_weights("lean"), level_master_weights("O3")
    ('fp32', 'kahan', False)
    """
    return {"O2": "fp32", "lean": "kahan"}.get(level, False)


def _check_master_weights(value: Any, level: str, dtype: torch.dtype, optimizer: Any) -> Any:
    """The ``master_weights`` mode for ``level``: its default for ``None``, else checked."""
    if value is None:
        return level_master_weights(level)
    mode = master_weight_mode(value)
    if optimizer is None and mode:
        raise ValueError(f"master_weights={value!r} needs an optimizer to apply it to")
    if mode and level in ("O0", "O1"):
        raise ValueError(
            f"master_weights={value!r} with level={level!r}: {level} keeps every parameter in "
            "float32, so there is nothing to keep masters of; use O2, O3 or lean"
        )
    if mode in ("split", "stochastic") and dtype != torch.bfloat16:
        raise ValueError(
            f"master_weights={value!r} works on bfloat16 parameters, got dtype={dtype}; "
            "use dtype=torch.bfloat16, or master_weights='fp32'/'kahan' for float16"
        )
    return mode
