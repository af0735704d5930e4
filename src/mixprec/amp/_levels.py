"""Amp levels O0-O3, lean and auto for a whole model and its optimizer: the plan, the lists, the hardware.

``amp.initialize``: precision levels O0-O3 on module granularity.

::

    level  parameters stored      computes in low precision          loss scale     masters
    O0     float32                nothing                            none           no
    O1     float32                what torch.autocast runs low on    dynamic (fp16)  no
                                  the device: the forward runs under  none (bf16)
                                  torch.autocast(device, dtype), bit
                                  for bit (own lists: see below)
    O2     low; norms float32     everything but the deny list        dynamic (fp16)  float32, in
                                  (BatchNorm, LayerNorm, GroupNorm..) none (bf16)     the optimizer
    O3     low, norms too         everything                          none           no
    lean   O3 in bfloat16 (or float16), every update Kahan-compensated: none     no (2 B/param
           compensation buffer, ``master_weights="kahan"``; float32-like updates at 8
           bytes per parameter with AdamW against O2's 14, see master_weights)
    auto   by the hardware (see choose_auto): CUDA O2, bfloat16 at compute capability
           >= 8.0, else float16 with a dynamic loss scale; a CPU with bfloat16 units O1
           bfloat16; any other CPU O0 (float32)

At every level the model's floating inputs are cast to its compute dtype on entry
(float32 at O0 and O1) and its floating outputs to float32, so the loss is computed
in float32. bfloat16
has float32's exponent range, so its gradients do not underflow: no level scales a
bfloat16 loss by default (each still skips a step whose gradients overflow, after a
read-only check).

O3 (and O2 with ``master_weights=False``) steps low-precision parameters directly, so
Adam's moments are float16 too. An
``eps`` below float16's smallest normal number (6.1e-05), like Adam's default 1e-8,
rounds to (almost) zero there and the first applied step turns every weight NaN or inf.
:func:`initialize` refuses that up front (``ValueError`` naming the group and ``eps``)
rather than keeping the state in float32 behind the optimizer's back, which is what
O2's master weights are for. Use ``eps >= 1e-4``, bfloat16, SGD, or O2.

O1 with the default lists hooks only the model itself: its forward-pre hook enters
``torch.autocast(device_type, dtype)`` (the device of the model's inputs) and its
forward hook leaves it and casts the output to float32. Every op then runs where
the device's autocast lists put it (on a CPU BatchNorm, ReLU, ``pow`` and ``tanh``
stay low, on CUDA softmax, norms and losses run float32), the outputs and
gradients are ``torch.autocast``'s bit for bit, and autocast's cache of weight
casts lives only inside the forward. Regions given a policy of their own (by the
user beforehand, or normalisation layers with ``keep_batchnorm_fp32=True``) run
with autocast off, in their own dtype.

O1 with lists of the user's own (``white_list``/``black_list`` other than the
defaults) applies them itself: listed modules are hooked, and listed functions
are cast by a torch function mode, which exists only when the lists name
functions. There a listed module's parameters are cast on the fly, once per
forward pass, and the casts are dropped when the pass ends.
``nn.MultiheadAttention`` feeds raw Parameters to ``F.multi_head_attention_forward``
instead of calling ``nn.Linear`` modules, so the default white list names the
module type itself: its inputs and all its parameters (``out_proj`` included) are
cast on entry, and every matmul inside runs low. ``nn.TransformerEncoderLayer``
works at every level in training and evaluation: its fused inference fast path
declines modules with hooks (and autocast) and runs the regular layers.

The plan of an amp level: which modules own a policy, and in which dtypes.
--------------------------------------------------------------------------

:func:`plan_level` decides it without touching the model; ``amp.initialize`` applies
it. :func:`low_params` names the parameters a plan stores in low precision.

``auto``: the amp level and low precision the hardware calls for, and why.
--------------------------------------------------------------------------

>>> import torch
>>> level, dtype, reason = choose_auto("cpu")
>>> (level, dtype) in (("O1", torch.bfloat16), ("O0", torch.float32))
True

Which module types and torch functions run in low precision, and which in float32.
----------------------------------------------------------------------------------

The *white list* (allow list) holds what is numerically safe and fast in float16 /
bfloat16: matrix products and convolutions, as module types and as functions. The
*black list* (deny list) holds what must stay float32: normalisation layers, whose
statistics lose too much in 8 or 11 bits of mantissa, and the functions that
``torch.autocast`` runs in float32 on CUDA (softmax, the norms, losses, exp/log/pow,
sums and products), whose range or accumulation float16 cannot hold.

``amp.initialize`` uses them per level. O1 left with these defaults runs the model
under ``torch.autocast``, whose own per-device lists decide (see above); given lists
of the user's own (start from copies of these), O1 runs white-listed modules and
functions low inside a float32 model and keeps their outputs low, so the next
white-listed op takes them without a cast, while black-listed modules and functions
cast their inputs up and return float32. O2 runs black-listed modules in float32
inside a low model (the default functions are O1's: O2 computes everything else low
by design). Wherever both apply, the innermost listed module (or the function)
decides, so a black-listed layer inside a white-listed block stays float32.

Entries are ``nn.Module`` subclasses (matched with ``isinstance``) or torch
functions that ``__torch_function__`` can intercept (``torch.matmul``,
``F.softmax``, ``torch.Tensor.bmm``...). A function also covers its namesakes in
``torch``, ``torch.nn.functional`` and the ``torch.Tensor`` methods (``torch.matmul``
covers ``a.matmul(b)`` and ``a @ b``). Functions are seen where the model's own
forward code calls them, not inside another torch function: the matmuls inside
``F.multi_head_attention_forward`` are reached by listing the module,
``nn.MultiheadAttention``, which is on the default white list.

>>> import torch
>>> torch.nn.Linear in get_white_list(), torch.nn.LayerNorm in get_black_list()
(True, True)
>>> get_white_list() is get_white_list()        # copies: edit freely
False
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import get_overridable_functions

from mixprec._checks import LOW_PRECISION as _LOW
from mixprec._checks import as_low_precision, check_bool, check_choice
from mixprec.amp._casting import (
    FunctionLists,
    _walk_region,
    apply_policies,
    check_module,
    claim_tree,
    get_state,
    state_of,
)
from mixprec.loss_scale import LossScale, default_loss_scale, loss_scale_from_spec
from mixprec.optim import LossScaleOptimizer
from mixprec.optim._masters import master_weight_mode
from mixprec.policy import Policy

if TYPE_CHECKING:
    from mixprec.typing import Float8Recipe, Level, LossScaleSpec, LowPrecision, MasterWeights

__all__ = [
    "initialize",
    "LEVELS",
    "check_fp8",
    "check_master_weights",
    "check_level_name",
    "level_master_weights",
    "resolve_level",
    "choose_auto",
    "cpu_has_fast",
    "plan_level",
    "low_params",
    "get_white_list",
    "get_black_list",
    "check_list",
    "split_list",
]

_log = logging.getLogger("mixprec.amp")

#: The level names :func:`initialize` accepts.
LEVELS = ("O0", "O1", "O2", "O3", "lean", "auto")


def check_level_name(level: Any) -> Level:
    """``level`` checked and normalised (``"o2"`` -> ``"O2"``); a clear error otherwise."""
    if not isinstance(level, str):
        raise TypeError(
            f"level must be a str, one of {LEVELS}, got {type(level).__name__} {level!r}"
        )
    word = level.strip().lower()
    normal = word if word in ("auto", "lean") else level.strip().upper()
    if normal not in LEVELS:
        hint = ("; the graph rewrite is mixprec.rewrite.rewrite(model, example_inputs, dtype)"
                if word == "rewrite" else "")  # fmt: skip  # (the CLI's --level rewrite)
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}{hint}")
    return cast("Level", normal)  # one of LEVELS, the canonical spellings


def _check_dtype(dtype: LowPrecision) -> torch.dtype:
    return as_low_precision(
        dtype, "dtype", hint="the low precision of the level; use level='O0' for float32"
    )


def _check_optimizer_eps(optimizer: torch.optim.Optimizer, low: set[int], level: str) -> None:
    """Refuse an ``eps`` that float16 optimizer state cannot hold (see the module)."""
    floor = torch.finfo(torch.float16).tiny
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps >= floor:
            continue
        if any(id(p) in low for p in group["params"]):
            raise ValueError(
                f"optimizer param group {i} has eps={eps:g}, below float16's smallest normal "
                f"number {floor:.3g}: {level} without float32 master weights keeps "
                f"{type(optimizer).__name__}'s state in float16, "
                "where it rounds to ~0 and the first applied step makes the weights NaN/inf; "
                "pass eps>=1e-4, use bfloat16, or O2 (float32 masters and optimizer state)"
            )


def _check_loss_scale(loss_scale: LossScaleSpec, level: Level, dtype: torch.dtype) -> LossScale:
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
        level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"lean"`` or ``"auto"`` (table
            in this module).
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
            ``False``. ``"split"``, ``"split8"`` and ``"stochastic"`` need bfloat16. O0/O1 keep float32
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
    bfloat16 units: O1 in bfloat16, that is ``torch.autocast("cpu", torch.bfloat16)``,
    which keeps float32 parameters and needs no master-weight memory. O3 in
    float16 with an ``eps`` below float16's range (Adam's 1e-8) is refused (module doc).

    Algorithm::

        validate every argument                      # a rejected call changes nothing
        plan <- owners and policies for the level    # see level_plan.plan_level
        store each region's parameters in its param dtype (in place, same Parameters)
        fp8: swap eligible nn.Linear layers for Float8Linear (same Parameters)
        install the hooks (mixprec.amp._casting): O1 with the default lists hooks only
            the root, which runs the forward under torch.autocast; O1 with lists of
            the user's own: a function-cast mode on the root if they name functions
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
    masters = check_master_weights(master_weights, level, dtype)
    if optimizer is None and master_weights is not None and masters:
        raise ValueError(f"master_weights={master_weights!r} needs an optimizer to apply it to")
    fp8_recipe = check_fp8(fp8)
    lean = level == "lean"
    level = "O3" if lean else level  # lean is O3's casts with compensated updates
    if level in ("O0", "O1") and keep_batchnorm_fp32 is False:
        raise ValueError(
            f"keep_batchnorm_fp32=False with level={level!r}: {level} stores every parameter "
            "float32 (O1 computes as torch.autocast does); use O3 for low-precision "
            "normalisation layers, or None for the level's default"
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

    autocast = level == "O1" and _is_default(white, black)
    if autocast:
        # torch.autocast decides every op; keep_batchnorm_fp32=True asks for float32
        # normalisation layers on top (regions of their own, autocast off inside).
        white, black = (), (_BLACK_MODULES if keep_batchnorm_fp32 else ())
        black += _lstms_autocast_cannot_run(model, dtype)
    elif level == "O1":
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
    named = "lean" if lean else level
    if optimizer is not None and float16_optimizer_state(named, dtype, masters):
        _check_optimizer_eps(optimizer, low_params(model, plan), named)
    if fp8_recipe:
        from mixprec.float8 import convert_to_float8  # float8 loads only when asked for

        report = convert_to_float8(model, fp8_recipe)
        if not report.converted:  # nothing was swapped: the model is as it was
            raise ValueError(
                f"fp8={fp8!r}: no linear layer of the model can run in float8\n{report}"
            )
        _log.info("%s", report)
        plan = plan_level(model, level, dtype, white_modules, black_modules)  # the new layers

    claim_tree(model)
    apply_policies(plan, bare=[model] if autocast else ())
    root = state_of(model)  # claimed above
    root.level = "lean" if lean else level
    root.autocast = dtype if autocast else None
    if white_functions or black_functions:
        root.functions = FunctionLists(
            white_functions, black_functions, dtype, keep_outputs=level == "O1"
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


def check_fp8(fp8: Any) -> Literal["dynamic", "delayed"] | None:
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
    from mixprec.float8._scaling import RECIPES

    return check_choice("fp8", fp8, tuple(RECIPES), hint="or True for 'dynamic'")


def level_master_weights(level: str) -> MasterWeights:
    """The ``master_weights`` mode ``level`` uses by default.

    >>> level_master_weights("O2"), level_master_weights("lean"), level_master_weights("O3")
    ('fp32', 'kahan', False)
    """
    if level == "O2":
        return "fp32"
    return "kahan" if level == "lean" else False


def float16_optimizer_state(level: str, dtype: torch.dtype, masters: Any) -> bool:
    """Whether ``level`` in ``dtype`` with master-weight mode ``masters`` (as
    :func:`check_master_weights` returns it) has the optimizer step float16 parameters,
    so that its state (Adam's moments) is float16 too: O3 and lean, and O2 without
    master weights. Adam's default ``eps=1e-8`` is below float16's range there.

    >>> float16_optimizer_state("O3", torch.float16, False), float16_optimizer_state("O2", torch.float16, "fp32")
    (True, False)
    """
    if dtype != torch.float16 or level not in ("O2", "O3", "lean"):
        return False
    return level != "O2" or not masters


def check_master_weights(value: MasterWeights | None, level: Level, dtype: torch.dtype) -> MasterWeights:
    """The ``master_weights`` mode for ``level``: its default for ``None``, else checked.

    >>> check_master_weights(None, "O2", torch.bfloat16), check_master_weights("split8", "O2", torch.bfloat16)
    ('fp32', 'split8')
    """
    if value is None:
        return level_master_weights(level)
    mode = master_weight_mode(value)
    if mode and level in ("O0", "O1"):
        raise ValueError(
            f"master_weights={value!r} with level={level!r}: {level} keeps every parameter in "
            "float32, so there is nothing to keep masters of; use O2, O3 or lean"
        )
    if mode in ("split", "split8", "stochastic") and dtype != torch.bfloat16:
        raise ValueError(
            f"master_weights={value!r} works on bfloat16 parameters, got dtype={dtype}; "
            "use dtype=torch.bfloat16, or master_weights='fp32'/'kahan' for float16"
        )
    return mode


# --------------------------------------------------------------------------------------

def plan_level(
    model: nn.Module,
    level: str,
    dtype: torch.dtype,
    white: tuple[type[nn.Module], ...],
    black: tuple[type[nn.Module], ...],
) -> list[tuple[nn.Module, Policy, bool]]:
    """The owners and policies that ``level`` gives ``model`` (no change to the model).

    ::

        r0 <- f32 for O0/O1, low for O2/O3; the root itself listed: flip it as below
        root <- (param dtype of r0's regions, r0, f32)
        walk(module, region dtype r):
            child has a user policy: keep it, skip its subtree
            r != low and child in white: child <- (p, low, out(low, r)); walk(child, low)
            (r == low or O1) and child in black: child <- (f32, f32, out(f32, r)); walk(child, f32)
            else: walk(child, r)

    with ``p`` float32 in O1 (parameters cast on the fly) and ``low`` in O2/O3, and
    ``out(own, r)`` the child's own dtype in O1 (as ``torch.autocast``: an allow-listed
    op's output stays low for the next one, a deny-listed op casts up and returns
    float32) and the region's ``r`` in O2/O3 (the model around the child keeps its dtype).
    O1 with the default lists is planned with empty ones (plus the normalisation
    types for ``keep_batchnorm_fp32=True``): ``torch.autocast`` decides the rest.
    """
    f32 = torch.float32
    white_param = f32 if level == "O1" else dtype
    root_dtype = f32 if level in ("O0", "O1") else dtype
    root_param = root_dtype
    # The model may itself be a listed module (amp.initialize(nn.Linear(...)), "O1").
    if root_dtype != dtype and white and isinstance(model, white):
        root_dtype, root_param = dtype, white_param
    elif root_dtype == dtype and black and isinstance(model, black):
        root_dtype = root_param = f32
    plan = [
        (model, Policy(param_dtype=root_param, compute_dtype=root_dtype, output_dtype=f32), False)
    ]

    def walk(module: nn.Module, region: torch.dtype, seen: set[int]) -> None:
        for child in module._modules.values():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            state = get_state(child)
            if state is not None and state.policy is not None and state.user_policy:
                continue
            if region != dtype and white and isinstance(child, white):
                out = dtype if level == "O1" else region
                policy = Policy(param_dtype=white_param, compute_dtype=dtype, output_dtype=out)
                plan.append((child, policy, False))
                walk(child, dtype, seen)
            elif (region == dtype or level == "O1") and black and isinstance(child, black):
                out = f32 if level == "O1" else region
                plan.append((child, Policy(param_dtype=f32, output_dtype=out), False))
                walk(child, f32, seen)
            else:
                walk(child, region, seen)

    walk(model, root_dtype, {id(model)})
    return plan


def low_params(model: nn.Module, plan: list[tuple[nn.Module, Policy, bool]]) -> set[int]:
    """Ids of the parameters the plan stores in low precision."""
    owners = {id(m) for m, _, _ in plan}
    owners |= {id(m) for m in model.modules() if (s := get_state(m)) and s.policy is not None}
    low: set[int] = set()
    for owner, policy, _ in plan:
        if policy.param_dtype in _LOW:
            for module in _walk_region(owner, owners - {id(owner)}):
                low |= {id(p) for p in module._parameters.values() if p is not None}
    return low


# --------------------------------------------------------------------------------------


# What "auto" means on a CPU, decided by measurement (AVX512-BF16 CPU, one thread,
# 4-layer transformer encoder d=512, 8 heads, seq 128, batch 8, forward + backward +
# AdamW step, CPU time as a fraction of float32's, several runs): O2 bf16 0.36-0.37,
# torch.autocast bf16 0.35-0.36, which O1 now is. O2 keeps weights and activations
# in bf16 and pays the float32 norm boundaries and the master-weight copies.
_CPU_AUTO_LEVEL: Final = "O1"


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def cpu_has_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU has ``dtype`` units, by oneDNN's check (else, e.g. AVX2 only, its
    matmuls are emulated ~100x slower than float32).

    >>> cpu_has_fast(torch.bfloat16) in (True, False)
    True
    """
    name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    try:
        return bool(getattr(torch.ops.mkldnn, name[dtype])())
    except (KeyError, AttributeError, RuntimeError):  # no such check in this build: no units
        return False


def choose_auto(device: torch.device | str) -> tuple[Level, torch.dtype, str]:
    """``(level, dtype, reason)``: what ``auto`` picks on ``device`` (table above), and why.

    >>> level, dtype, reason = choose_auto("cpu")
    >>> (level, dtype) in (("O1", torch.bfloat16), ("O0", torch.float32))
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        cap = "{}.{}".format(*torch.cuda.get_device_capability(device))
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return "O2", torch.bfloat16, f"CUDA compute capability {cap} >= 8.0: bfloat16 units"
        why = f"CUDA compute capability {cap} < 8.0: no bfloat16 units, float16 + loss scaling"
        return "O2", torch.float16, why
    if device.type != "cpu":
        return "O0", torch.float32, f"no known fast low precision on {device.type}: float32"
    if cpu_has_fast(torch.bfloat16):
        return _CPU_AUTO_LEVEL, torch.bfloat16, "this CPU has bfloat16 units"
    why = "this CPU has no bfloat16 units: bfloat16 would be emulated, far slower than float32"
    return "O0", torch.float32, why


def resolve_level(model: nn.Module, level: Level, dtype: torch.dtype) -> tuple[Level, torch.dtype]:
    """The concrete ``(level, dtype)`` that ``level`` means for ``model`` (``auto`` decides)."""
    if level != "auto":
        return level, dtype
    level, dtype, reason = choose_auto(_model_device(model))
    _log.info("auto: level %s, %s: %s", level, dtype, reason)
    return level, dtype


# --------------------------------------------------------------------------------------

_WHITE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.RNN,
    nn.LSTM,
    nn.GRU,
    nn.RNNCell,
    nn.LSTMCell,
    nn.GRUCell,
    nn.PReLU,
    # Its projections are raw Parameters fed to F.multi_head_attention_forward: listing
    # the module casts them (cached) and runs every matmul inside it low.
    nn.MultiheadAttention,
)

_WHITE_FUNCTIONS: tuple[Any, ...] = (
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.baddbmm,
    torch.addmm,
    torch.addbmm,
    torch.einsum,
    F.linear,
    F.bilinear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.prelu,
    F.scaled_dot_product_attention,
)

_BLACK_MODULES: tuple[type[nn.Module], ...] = tuple(
    cls
    for cls in (
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        nn.LazyBatchNorm1d,
        nn.LazyBatchNorm2d,
        nn.LazyBatchNorm3d,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),  # torch >= 2.4
        nn.LocalResponseNorm,
    )
    if cls is not None
)


# As torch.autocast's float32 list on CUDA, for the functions a model's forward calls.
_BLACK_FUNCTIONS: tuple[Any, ...] = (
    F.softmax,
    F.log_softmax,
    F.softmin,
    F.layer_norm,
    F.group_norm,
    F.cosine_similarity,
    F.softplus,
    F.pdist,
    torch.cdist,
    torch.dist,
    torch.norm,
    torch.renorm,
    torch.exp,
    torch.expm1,
    torch.log,
    torch.log2,
    torch.log10,
    torch.log1p,
    torch.pow,
    torch.rsqrt,
    torch.reciprocal,
    torch.logsumexp,
    torch.sum,
    torch.prod,
    torch.cumsum,
    torch.cumprod,
    torch.acos,
    torch.asin,
    torch.cosh,
    torch.sinh,
    torch.tan,
    torch.erfinv,
    F.cross_entropy,
    F.nll_loss,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.kl_div,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.poisson_nll_loss,
    F.gaussian_nll_loss,
    F.cosine_embedding_loss,
    F.hinge_embedding_loss,
    F.margin_ranking_loss,
    F.soft_margin_loss,
    F.multi_margin_loss,
    F.multilabel_margin_loss,
    F.multilabel_soft_margin_loss,
    F.triplet_margin_loss,
)


def get_white_list() -> list[Any]:
    """A copy of the default allow list: module types, then functions.

    O1 given exactly the defaults runs ``torch.autocast`` (its per-device lists
    decide); edit a copy to give O1 lists of your own, which it then applies itself.

    >>> import torch
    >>> white = get_white_list() + [torch.nn.Embedding]  # O1 runs these, and only these, low
    >>> torch.nn.Linear in white and torch.matmul in white
    True
    """
    return [*_WHITE_MODULES, *_WHITE_FUNCTIONS]


def get_black_list() -> list[Any]:
    """A copy of the default deny list: normalisation module types (float32 at O2),
    then the functions ``torch.autocast`` runs float32 on CUDA (O1 with lists of
    the user's own; see :func:`get_white_list`).

    >>> import torch
    >>> torch.nn.BatchNorm2d in get_black_list(), torch.nn.functional.softmax in get_black_list()
    (True, True)
    """
    return [*_BLACK_MODULES, *_BLACK_FUNCTIONS]


@functools.lru_cache(maxsize=1)
def _interceptable() -> frozenset:
    return frozenset(f for fs in get_overridable_functions().values() for f in fs)


def _namesakes(func: Any) -> set[Any]:
    """``func`` and the same-named torch / functional / Tensor functions."""
    name = getattr(func, "__name__", None)
    found = {func}
    if name is None:
        return found
    for namespace in (torch, F, torch.Tensor):
        other = getattr(namespace, name, None)
        if other is not None and other in _interceptable():
            found.add(other)
    if name == "matmul":
        found.update({torch.Tensor.__matmul__, torch.Tensor.__rmatmul__})
    return found


def _is_default(white: tuple[Any, ...] | None, black: tuple[Any, ...] | None) -> bool:
    """Whether O1's lists are the defaults (left out, or passed as they are), which
    O1 runs as ``torch.autocast`` itself."""
    return (white is None or set(white) == set(get_white_list())) and (
        black is None or set(black) == set(get_black_list())
    )


def check_list(name: str, value: Any) -> tuple[Any, ...] | None:
    """Validate a user's white or black list; return it as a tuple (``None`` stays)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, type)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be a list of nn.Module types and torch functions, got "
            f"{type(value).__name__} {value!r}; e.g. {name}=[torch.nn.Linear, torch.matmul]"
        )
    items = tuple(value)
    for item in items:
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise TypeError(
                    f"{name} entry {item!r} is a class but not an nn.Module subclass; "
                    "list module types such as torch.nn.Linear"
                )
        elif isinstance(item, nn.Module):
            raise TypeError(
                f"{name} entry {type(item).__name__}(...) is a module instance; list its type, "
                f"{type(item).__name__}, or give the instance its own policy with "
                "mixprec.amp.set_policy / to_float"
            )
        elif item not in _interceptable():
            raise TypeError(
                f"{name} entry {item!r} is not a torch function that __torch_function__ can "
                "intercept (torch.*, torch.nn.functional.*, torch.Tensor methods); put the code "
                "in an nn.Module and list the module's type instead"
            )
    return items


def split_list(items: Iterable[Any]) -> tuple[tuple[type[nn.Module], ...], frozenset]:
    """``(module types, functions with their namesakes)`` of a checked list."""
    modules = tuple(item for item in items if isinstance(item, type))
    functions: set[Any] = set()
    for item in items:
        if not isinstance(item, type):
            functions |= _namesakes(item)
    return modules, frozenset(functions)
