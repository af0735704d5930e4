"""``amp.initialize``: prepare a model and its optimizer for one amp level, in place.

What each level does is its :class:`~mixprec.amp.LevelSpec` (:data:`~mixprec.amp.LEVEL_SPECS`);
the levels guide (docs/guides/levels.md) explains them. :func:`initialize` checks every
argument first (a rejected call changes nothing), plans the level
(:mod:`mixprec.amp._level_plan`), stores the parameters, installs the hooks
(:mod:`mixprec.amp._cast_hooks`) and wraps the optimizer.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from mixprec._checks import as_low_precision, check_bool, check_choice
from mixprec.amp._auto import resolve_level
from mixprec.amp._cast_hooks import FunctionLists, get_state, state_of
from mixprec.amp._claim import claim_tree
from mixprec.amp._level_plan import low_params, plan_level
from mixprec.amp._level_specs import (
    LevelSpec,
    check_level_name,
    check_master_weights,
    float16_optimizer_state,
    spec_of,
)
from mixprec.amp._lists import (
    BLACK_MODULES,
    LOSS_FUNCTIONS,
    check_list,
    get_black_list,
    get_white_list,
    is_default,
    split_list,
)
from mixprec.amp._module_policy import apply_policies, check_module
from mixprec.loss_scale import LossScale, loss_scale_from_spec
from mixprec.optim import LossScaleOptimizer

if TYPE_CHECKING:
    from mixprec.typing import Float8Recipe, Level, LossScaleSpec, LowPrecision, MasterWeights

_log = logging.getLogger("mixprec.amp")


def _check_dtype(dtype: LowPrecision) -> torch.dtype:
    return as_low_precision(
        dtype, "dtype", hint="the low precision of the level; use level='O0' for float32"
    )


def _check_optimizer_eps(
    optimizer: torch.optim.Optimizer, low: set[int], level: str, masters: Any
) -> None:
    """Refuse an ``eps`` that float16 optimizer state cannot hold (see :func:`initialize`)."""
    floor = torch.finfo(torch.float16).tiny
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps >= floor:
            continue
        if any(id(p) in low for p in group["params"]):
            raise ValueError(
                f"optimizer param group {i} has eps={eps:g}, below float16's smallest normal "
                f"number {floor:.3g}: {level} with master_weights={masters!r} steps the float16 "
                f"parameters themselves and keeps {type(optimizer).__name__}'s state in float16, "
                "where it rounds to ~0 and the first applied step makes the weights NaN/inf; "
                "pass eps>=1e-4, use bfloat16, or master_weights='fp32' (float32 masters and "
                "optimizer state)"
            )


def _check_loss_scale(loss_scale: LossScaleSpec, spec: LevelSpec, dtype: torch.dtype) -> LossScale:
    if loss_scale is None:
        return spec.default_loss_scale(dtype)
    try:
        return loss_scale_from_spec(loss_scale)
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"{err}; loss_scale=None picks the level's default (dynamic for float16 O1/O2)"
        ) from None


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    level: Level = "O1",
    dtype: LowPrecision = torch.float16,
    keep_batchnorm_fp32: bool | None = None,
    loss_scale: LossScaleSpec = None,
    white_list: Any = None,
    black_list: Any = None,
    master_weights: MasterWeights | None = None,
    fp8: Float8Recipe = False,
) -> tuple[nn.Module, Any]:
    """Prepare ``model`` (in place) and ``optimizer`` for mixed-precision training at ``level``.

    Args:
        model: a float32 ``nn.Module``. Submodules given a policy beforehand
            (:func:`set_policy`, :func:`to_float`) keep it.
        optimizer: optional ``torch.optim.Optimizer`` over the model's parameters;
            returned wrapped as :class:`mixprec.optim.LossScaleOptimizer` (``None``
            gives ``None``). Use it as ``opt.scale_loss(loss).backward(); opt.step();
            opt.zero_grad()``.
        level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"lean"`` or ``"auto"``
            (:data:`LEVEL_SPECS`; the table of the levels guide).
        dtype: the low precision, ``torch.float16`` or ``torch.bfloat16``.
        keep_batchnorm_fp32: keep normalisation layers float32; default ``True`` for
            O2, ``False`` for O3. O0/O1 store every parameter float32 (``False`` is
            refused there); ``True`` at O1 also computes the normalisation layers in
            float32, where ``None`` leaves them to ``torch.autocast``.
        loss_scale: ``None`` (the level's default), ``"dynamic"``, a number (static
            scale) or a :class:`mixprec.loss_scale.LossScale`.
        white_list, black_list: module types and torch functions replacing the
            defaults (:func:`get_white_list`, :func:`get_black_list`). O1 with both
            left as ``None`` (or passed as the defaults) is ``torch.autocast``; with
            lists of the user's own it runs the white list low, keeping its outputs
            low, and the black list float32 wherever it is. O2/O3 run the black
            list's modules (and any function passed in ``black_list``) float32 and,
            inside them, the white list low.
        master_weights: what the optimizer steps for the low-precision parameters of O2,
            O3 and lean (:class:`~mixprec.optim.LossScaleOptimizer`'s option): ``None``
            the level's own (O2 ``"fp32"``, lean ``"kahan"``, O3 ``False``), or
            ``"fp32"``/``True``, ``"split"``, ``"split8"``, ``"kahan"``, ``"stochastic"``,
            ``False``. ``"split"``, ``"split8"`` and ``"stochastic"`` need bfloat16.
            O0/O1 keep float32 parameters, so anything but ``None``/``False`` is
            refused there.
        fp8: run the model's eligible ``nn.Linear`` layers in float8 (forward and both
            backward matmuls, :mod:`mixprec.float8`) at any level: ``True`` or
            ``"dynamic"`` (per-tensor scales from the current amax), ``"delayed"``
            (from an amax history, as Transformer Engine), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"`` (a scale per row, as torchao's recipes of those
            names), ``False`` (default). The
            layers are swapped in place, keeping their Parameters; which ran in float8
            and why the others did not goes to the ``mixprec.amp`` logger
            (:func:`mixprec.float8.convert_to_float8` gives the same report). A model
            with no eligible layer is refused.

    ``auto`` picks level and dtype by the hardware of the model's parameters, whatever
    ``dtype`` says (:func:`choose_auto`; the choice and why go to the ``mixprec.amp``
    logger). CUDA: O2 (tensor cores; O2 halves weight and activation memory). A CPU with
    bfloat16 units: O1 in bfloat16, that is ``torch.autocast("cpu", torch.bfloat16)``,
    which keeps float32 parameters and needs no master-weight memory. O3 in
    float16 with an ``eps`` below float16's range (Adam's 1e-8) is refused: its optimizer
    state is float16, where such an ``eps`` rounds to zero (the levels guide).

    Algorithm::

        validate every argument                      # a rejected call changes nothing
        plan <- owners and policies for the level    # _level_plan.plan_level
        store each region's parameters in its param dtype (in place, same Parameters)
        fp8: swap eligible nn.Linear layers for Float8Linear (same Parameters)
        install the hooks (_cast_hooks): O1 with the default lists runs each call
            that enters the model (through the root or any submodule) under
            torch.autocast, once; O1 with lists of the user's own: a function-cast
            mode on the root if they name functions
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
    spec = spec_of(level)  # a concrete level: auto decided above
    masters = check_master_weights(master_weights, level, dtype)
    if optimizer is None and master_weights is not None and masters:
        raise ValueError(f"master_weights={master_weights!r} needs an optimizer to apply it to")
    fp8_recipe = check_fp8(fp8)
    if spec.storage == "float32" and keep_batchnorm_fp32 is False:
        raise ValueError(
            f"keep_batchnorm_fp32=False with level={level!r}: {level} stores every parameter "
            "float32 (O1 computes as torch.autocast does); use O3 for low-precision "
            "normalisation layers, or None for the level's default"
        )
    if not spec.low_precision and (white is not None or black is not None):
        raise ValueError(f"{level} runs everything in float32: white_list/black_list must be None")
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
    scaler = _check_loss_scale(loss_scale, spec, dtype) if optimizer is not None else None

    autocast = spec.forward == "autocast" and is_default(white, black)
    if autocast:
        # torch.autocast decides every op; keep_batchnorm_fp32=True asks for float32
        # normalisation layers on top (regions of their own, autocast off inside).
        white, black = (), (BLACK_MODULES if keep_batchnorm_fp32 else ())
        black += _lstms_autocast_cannot_run(model, dtype)
    elif spec.forward == "autocast":  # lists of the user's own, with autocast's rules
        white = tuple(get_white_list()) if white is None else white
        black = tuple(get_black_list()) if black is None else black
    elif spec.forward == "casts":
        default_keep = spec.keep_norms_float32
        keep = keep_batchnorm_fp32 if keep_batchnorm_fp32 is not None else default_keep
        # The default functions are O1's: at O2/O3 the whole model computes low by design.
        black = (BLACK_MODULES if keep else ()) if black is None else black
        white = () if white is None else white
    else:
        white = black = ()
    white_modules, white_functions = split_list(white)
    black_modules, black_functions = split_list(black)
    plan = plan_level(model, spec, dtype, white_modules, black_modules)
    if optimizer is not None and masters:
        low = low_params(model, plan)
        if not any(id(p) in low for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                f"master_weights={masters!r} ({level}) acts on the "
                "parameters stored in low precision, but the optimizer holds none of them "
                "(all are outside the model or in float32 layers); build the optimizer from "
                "model.parameters()"
            )
    if optimizer is not None and float16_optimizer_state(level, dtype, masters):
        _check_optimizer_eps(optimizer, low_params(model, plan), level, masters)
    if fp8_recipe:
        from mixprec.float8 import convert_to_float8  # float8 loads only when asked for

        report = convert_to_float8(model, fp8_recipe)
        if not report.converted:  # nothing was swapped: the model is as it was
            raise ValueError(
                f"fp8={fp8!r}: no linear layer of the model can run in float8\n{report}"
            )
        _log.info("%s", report)
        plan = plan_level(model, spec, dtype, white_modules, black_modules)  # the new layers

    claim_tree(model)
    apply_policies(plan, bare=[model] if autocast else ())
    root = state_of(model)  # claimed above
    root.level = level
    root.autocast = dtype if autocast else None
    if white_functions or black_functions:
        root.functions = FunctionLists(
            white_functions,
            black_functions,
            dtype,
            keep_outputs=spec.forward == "autocast",
            float32_outputs=black_functions & split_list(LOSS_FUNCTIONS)[1],
        )
    if optimizer is None:
        return model, None
    return model, LossScaleOptimizer(optimizer, loss_scale=scaler, master_weights=masters)


def _lstms_autocast_cannot_run(model: nn.Module, dtype: torch.dtype) -> tuple[type[nn.Module], ...]:
    """``(nn.LSTM,)`` where ``model`` has an LSTM on a CPU on which ``torch.autocast``
    cannot run one in ``dtype``, else ``()``: O1 then runs its LSTMs in float32, as
    regions of their own, where autocast would fail in the forward."""
    on_cpu = any(p.device.type == "cpu" for p in model.parameters())
    if not on_cpu or not any(isinstance(m, nn.LSTM) for m in model.modules()):
        return ()
    if _cpu_autocast_runs_lstm(dtype):
        return ()
    _log.info("O1: torch.autocast cannot run nn.LSTM in %s on this CPU; LSTMs run in float32", dtype)
    return (nn.LSTM,)


@functools.cache
def _cpu_autocast_runs_lstm(dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast("cpu", dtype)`` runs an ``nn.LSTM`` forward and backward:
    it casts the LSTM to ``dtype`` and calls oneDNN, which has no float16 LSTM on CPUs
    without float16 instructions ("could not create a primitive descriptor")."""
    with torch.random.fork_rng(devices=[]):  # the LSTM's initialisation draws numbers
        lstm = nn.LSTM(2, 2)
    try:
        with torch.autocast("cpu", dtype=dtype):
            out = lstm(torch.zeros(1, 1, 2))[0]
        out.float().sum().backward()
    except RuntimeError:
        return False
    return True


def check_fp8(fp8: Any) -> Literal["dynamic", "delayed", "rowwise", "rowwise_with_gw_hp"] | None:
    """The float8 recipe ``fp8`` asks for (``True`` is ``"dynamic"``), or ``None`` for none.

    >>> check_fp8(True), check_fp8("delayed"), check_fp8("rowwise"), check_fp8(False)
    ('dynamic', 'delayed', 'rowwise', None)
    """
    if fp8 is False or fp8 is None:
        return None
    if fp8 is True:
        return "dynamic"
    if not isinstance(fp8, str):
        raise TypeError(f"fp8 must be a bool or a recipe name, got {type(fp8).__name__} {fp8!r}")
    from mixprec.float8._scaling import RECIPES

    return check_choice("fp8", fp8, tuple(RECIPES), hint="or True for 'dynamic'")
