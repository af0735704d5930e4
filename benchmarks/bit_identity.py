"""Bit identity of training: a grid of tiny runs whose every bit is recorded, then checked.

::

    python -m benchmarks bit_identity --record FILE            # record the full grid
    python -m benchmarks bit_identity --check FILE             # compare with a record
    python -m benchmarks bit_identity --check FILE --quick     # the quick subset only
    python -m benchmarks bit_identity --record FILE --fused    # + the compiled fused steps

What it measures: whether a change to the library changes what training computes, to
the last bit. Each case trains a tiny model (an MLP with LayerNorm, 604 parameters, or
a CNN with BatchNorm, 228) for six steps through the public API only
(``mixprec.amp.initialize``, ``mixprec.LossScaleOptimizer``, ``mixprec.GradScaler``,
``mixprec.optim.AdamW8bit``, ``GradientRelease``, ``joint_step``, the loss-scale
classes), so the grid keeps working while the internals move. The grid crosses amp
levels, master-weight modes, inner optimizers, float16/bfloat16, an injected inf or NaN
gradient, the wrapper's options and torch's recipes (``unscale_()`` + clipping, the
``GradScaler`` loop, a dropped step, checkpoint save/load/continue, several optimizers
on one scale).

Recorded per case: a SHA-256 over the model's parameters, buffers and gradients (dtype,
shape and raw bytes, so -0.0 and NaN payloads count), every tensor and value of the
optimizer's ``state_dict()``, the loss scale and the step counters, and the warnings
the library raised; the digests of those parts; and a few readable numbers (loss
scale, ``iterations``, skipped steps, the last loss). A combination the library
refuses is recorded as ``"error: <type>: <message>"``: that is behaviour too.

``--check`` prints ``N identical, M differ, K missing`` (missing: run here, absent from
the record) and the differing cases with the parts that differ; it exits 1 on any
difference or missing case. Floating-point results depend on the CPU's kernels, so a
record holds the machine it was made on (torch version, CPU capability, oneDNN's
bfloat16 support); a check on another machine says so.

``--src DIR`` puts the mixprec sources in ``DIR`` first on the import path (to record
an older checkout with the current harness); the mixprec imported is printed.
``--fused`` adds rows with the compiled fused master-weight steps, which run on a CPU
only when switched on (10-80 s of compilation each; seconds from inductor's cache).

Size: 1533 cases (186 of them refusals), about 30 s on 2 cores; ``--quick`` 38 of
them, a few seconds; ``--fused`` 6 more, about two minutes to compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Case", "grid", "machine", "run_case", "run_grid", "dumps", "compare", "difference", "main",
]  # fmt: skip

STEPS = 6  # optimizer steps per case (micro-steps under gradient accumulation)
SAVE_AFTER = 3  # the resume recipe saves after this many steps and continues in a fresh run
SEED = 1234
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
INNERS = ("sgd", "adam", "adamw_foreach", "adamw_fused")
LEVELS = ("O0", "O1", "O2", "O3", "lean")
MASTER_MODES: tuple[Any, ...] = (False, "fp32", "split", "split8", "kahan", "stochastic")


# -- the cases ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the grid.

    ``api``: how the optimizer is built - ``"level"`` (``amp.initialize(model, opt,
    level, dtype, ...)``), ``"lso"`` (a model cast by ``cast``, then
    ``LossScaleOptimizer(inner, loss_scale, master_weights=..., **options)``),
    ``"release"`` (``GradientRelease``), ``"gradscaler"`` (``mixprec.GradScaler`` with
    ``torch.autocast``) or ``"joint"`` (two models, two optimizers, one loss scale).
    """

    api: str
    dtype: str
    inner: str
    level: str | None = None  # api "level"
    cast: str | None = None  # api "lso"/"joint": "hand" (Module.to), "O2"/"O3" (initialize), "none"
    master_weights: Any = None  # None: not passed (the level's or the API's default)
    loss_scale: Any = "default"  # "default": not passed; else a name _loss_scale knows
    options: tuple[tuple[str, Any], ...] = ()  # LossScaleOptimizer / GradientRelease kwargs
    recipe: str = "plain"  # plain, unscale_clip, unscale_drop, resume, separate (joint)
    overflow: str = "none"  # none, inf@2 (a gradient element at step 2), nan@0 (first step)
    model: str = "mlp"
    fused: bool = False  # the compiled fused master-weight step, switched on
    quick: bool = False  # part of the --quick subset

    @property
    def id(self) -> str:
        head = {"level": str(self.level), "lso": f"lso:{self.cast}", "joint": f"joint:{self.cast}"}
        parts = [head.get(self.api, self.api), self.dtype, self.inner]
        if self.master_weights is not None:
            parts.append(f"mw={self.master_weights}")
        if self.loss_scale != "default":
            parts.append(f"scale={self.loss_scale}")
        parts += [f"{k}={v}" for k, v in self.options]
        if self.recipe != "plain":
            parts.append(self.recipe)
        if self.model != "mlp":
            parts.append(self.model)
        if self.fused:
            parts.append("fused")
        if self.overflow != "none":
            parts.append(self.overflow)
        return "/".join(parts)


#: The joint row of the quick subset: (recipe, master weights, overflow, dtype, inner).
QUICK_JOINT = ("plain", "fp32", "inf@2", "fp16", "sgd")


def _bf16_only(mw: Any, dtype: str) -> bool:
    """Whether this mode refuses this dtype (split, split8 and stochastic are bfloat16's):
    such a row is recorded once, with no overflow, not in every variant."""
    return dtype == "fp16" and mw in ("split", "split8", "stochastic")


def grid(quick: bool = False, fused: bool = False) -> list[Case]:
    """The cases: the full grid, or its ``quick`` subset; ``fused`` adds compiled steps."""
    cases: list[Case] = []
    mw: Any  # a master-weight mode: False, True or a mode's name

    def add(case: Case) -> None:
        if not (_bf16_only(case.master_weights, case.dtype) and case.overflow != "none"):
            cases.append(case)

    overflows = ("none", "inf@2", "nan@0")
    inners = (*INNERS, "adamw8bit")

    # amp levels x inner optimizers x dtypes x overflow, each level's defaults.
    for level in LEVELS:
        for dtype in ("fp16", "bf16"):
            for inner in inners:
                for overflow in overflows:
                    q = inner == "adamw_foreach" and overflow != "nan@0" and level in ("O1", "O2")
                    add(Case("level", dtype, inner, level=level, overflow=overflow, quick=q))
            for model, inner in (("cnn", "sgd"), ("cnn", "adamw_foreach")):
                for overflow in ("none", "inf@2"):
                    q = level == "O2" and dtype == "bf16" and inner == "sgd" and overflow == "none"
                    add(Case("level", dtype, inner, level=level, model=model, overflow=overflow,
                             quick=q))  # fmt: skip
    # float16 state with an eps float16 holds (Adam's 1e-8 is refused at O3/lean above).
    for level in ("O2", "O3", "lean"):
        for overflow in ("none", "inf@2"):
            mw = False if level == "O2" else None
            add(Case("level", "fp16", "adamw_eps", level=level, master_weights=mw,
                     overflow=overflow))  # fmt: skip
    # bfloat16 scaled anyway; a loss scale that grows and backs off within the run.
    for scale in ("dynamic", "dyn_fast", "static"):
        for dtype in ("fp16", "bf16"):
            for overflow in ("none", "inf@2"):
                add(Case("level", dtype, "adamw_foreach", level="O2", loss_scale=scale,
                         overflow=overflow))  # fmt: skip
                add(Case("level", dtype, "sgd", level="O1", loss_scale=scale,
                         overflow=overflow))  # fmt: skip

    # Master-weight modes through amp.initialize: at O2 every mode, at O3 and lean the
    # modes that step the low-precision weights.
    for mw in MASTER_MODES:
        for dtype in ("fp16", "bf16"):
            for inner in inners:
                for overflow in overflows:
                    q = inner == "adamw_fused" and dtype == "bf16" and overflow == "none"
                    add(Case("level", dtype, inner, level="O2", master_weights=mw,
                             overflow=overflow, quick=q))  # fmt: skip
            add(Case("level", dtype, "sgd", level="O2", master_weights=mw, model="cnn",
                     overflow="inf@2"))  # fmt: skip
    for level in ("O3", "lean"):
        for mw in (False, "kahan", "stochastic"):
            for dtype in ("fp16", "bf16"):
                for overflow in ("none", "inf@2"):
                    add(Case("level", dtype, "adamw_eps", level=level, master_weights=mw,
                             overflow=overflow))  # fmt: skip

    # The plain wrapper on a model cast by hand, its loss scales, and on a float32 model.
    for mw in MASTER_MODES:
        for dtype in ("fp16", "bf16"):
            for inner in inners:
                for overflow in overflows:
                    q = mw == "fp32" and dtype == "fp16" and inner in ("sgd", "adamw_fused")
                    add(Case("lso", dtype, inner, cast="hand", master_weights=mw,
                             overflow=overflow, quick=q and overflow != "nan@0"))  # fmt: skip
    for inner in inners:
        for overflow in overflows:
            add(Case("lso", "fp32", inner, cast="none", overflow=overflow))
    for scale in ("none", "static", "dynamic", "dyn_fast", "dyn_hysteresis"):
        for inner in ("sgd", "adam"):
            for overflow in overflows:
                add(Case("lso", "fp16", inner, cast="hand", master_weights="fp32",
                         loss_scale=scale, overflow=overflow))  # fmt: skip
                add(Case("lso", "bf16", inner, cast="hand", master_weights="kahan",
                         loss_scale=scale, overflow=overflow))  # fmt: skip

    # Gradient release.
    for mw in (False, "fp32", "split", "split8"):
        for inner in ("sgd", "adamw_foreach", "adamw_fused", "adamw8bit"):
            for overflow in ("none", "inf@2"):
                q = mw == "split8" and inner == "adamw8bit"
                add(Case("release", "bf16", inner, master_weights=mw, overflow=overflow, quick=q))
    for mw in (False, "fp32", "split8"):  # float16 takes a fixed loss scale
        for overflow in ("none", "inf@2"):
            add(Case("release", "fp16", "adamw_eps", master_weights=mw, loss_scale="static",
                     overflow=overflow))  # fmt: skip
    for option in (("clipnorm", 0.05), ("clipvalue", 0.01)):
        for mw in (False, "split8"):
            add(Case("release", "bf16", "adamw_foreach", master_weights=mw, options=(option,)))
    for option in (("global_clipnorm", 1.0), ("gradient_accumulation_steps", 2)):
        add(Case("release", "bf16", "adamw_foreach", options=(option,)))  # refused
    add(Case("release", "fp16", "adamw_foreach", loss_scale="dynamic"))  # refused
    add(Case("release", "bf16", "adamw_foreach", master_weights="kahan"))  # refused
    for mw, inner in (("split8", "adamw8bit"), ("fp32", "adamw_foreach"), (False, "sgd")):
        add(Case("release", "bf16", inner, master_weights=mw, recipe="resume", overflow="inf@2"))

    # The wrapper's options, on a model cast by amp.initialize (O2, O3) or by hand.
    options: tuple[tuple[tuple[str, Any], ...], ...] = (
        (("clipnorm", 0.05),),
        (("global_clipnorm", 0.05),),
        (("clipvalue", 0.01),),
        (("weight_decay", 0.1),),
        (("use_ema", True), ("ema_momentum", 0.9)),
        (("use_ema", True), ("ema_momentum", 0.5), ("ema_overwrite_frequency", 2)),
        (("gradient_accumulation_steps", 2),),
        (("clipvalue", 0.02), ("global_clipnorm", 0.1), ("weight_decay", 0.05)),
        (("loss_scale_factor", 4.0),),
        (("skip_nonfinite", False),),
    )
    casts = (("O2", "fp32"), ("O2", "split"), ("O2", "split8"), ("O3", "kahan"),
             ("O3", "stochastic"), ("hand", False), ("hand", "fp32"))  # fmt: skip
    for opts in options:
        for cast, mw in casts:
            for dtype in ("fp16", "bf16"):
                for inner in ("adamw_foreach", "sgd"):
                    for overflow in ("none", "inf@2"):
                        q = (cast, mw, dtype, inner, overflow) == (
                            "O2", "fp32", "bf16", "adamw_foreach", "inf@2")  # fmt: skip
                        add(Case("lso", dtype, inner, cast=cast, master_weights=mw,
                                 options=opts, overflow=overflow, quick=q))  # fmt: skip
    for opts in options[:3] + options[6:7]:
        add(Case("lso", "bf16", "adamw_fused", cast="O2", master_weights="fp32", options=opts,
                 overflow="inf@2"))  # fmt: skip
        add(Case("lso", "bf16", "adamw8bit", cast="O2", master_weights="split8", options=opts,
                 overflow="inf@2"))  # fmt: skip
        add(Case("lso", "bf16", "sgd", cast="O2", master_weights="fp32", options=opts,
                 model="cnn"))  # fmt: skip

    # torch's recipes through the wrapper: unscale_() + clip_grad_norm_, a dropped step
    # (zero_grad() after unscale_()), and checkpoint save -> load -> continue.
    for recipe in ("unscale_clip", "unscale_drop", "resume"):
        for mw in MASTER_MODES:
            for dtype in ("fp16", "bf16"):
                for inner in ("adamw_foreach", "adamw_fused", "sgd"):
                    for overflow in ("none", "inf@2"):
                        q = recipe != "unscale_drop" and mw in ("fp32", "kahan")
                        q = q and (dtype, inner, overflow) == ("bf16", "adamw_foreach", "none")
                        add(Case("lso", dtype, inner, cast="O2", master_weights=mw,
                                 recipe=recipe, overflow=overflow, quick=q))  # fmt: skip
        for option in (("gradient_accumulation_steps", 2), ("use_ema", True)):
            add(Case("lso", "bf16", "adamw_foreach", cast="O2", master_weights="fp32",
                     options=(option,), recipe=recipe, overflow="inf@2"))  # fmt: skip
    for level in LEVELS:  # levels' own defaults, as amp.initialize builds them
        for recipe in ("unscale_clip", "unscale_drop", "resume"):
            for dtype in ("fp16", "bf16"):
                add(Case("level", dtype, "adamw_fused", level=level, recipe=recipe,
                         overflow="inf@2"))  # fmt: skip
    for recipe in ("unscale_clip", "resume"):
        for mw in ("split8", "fp32"):
            add(Case("level", "bf16", "adamw8bit", level="O2", master_weights=mw, recipe=recipe,
                     overflow="inf@2", quick=recipe == "resume" and mw == "split8"))  # fmt: skip
        add(Case("level", "fp16", "sgd", level="O2", recipe=recipe, model="cnn", overflow="inf@2"))

    # mixprec.GradScaler as a drop-in for torch.amp.GradScaler, under torch.autocast.
    for inner in INNERS:
        for dtype in ("fp16", "bf16"):
            for overflow in overflows:
                q = inner == "adamw_foreach" and dtype == "fp16" and overflow == "inf@2"
                add(Case("gradscaler", dtype, inner, overflow=overflow, quick=q))
            for recipe in ("unscale_clip", "resume"):
                for overflow in ("none", "inf@2"):
                    add(Case("gradscaler", dtype, inner, recipe=recipe, overflow=overflow))
    for overflow in ("none", "inf@2"):
        add(Case("gradscaler", "fp16", "adam", loss_scale="default_args", overflow=overflow))
        add(Case("gradscaler", "fp16", "sgd", model="cnn", overflow=overflow))

    # Two optimizers on one loss scale: joint_step, and each stepping on its own.
    for recipe in ("plain", "separate"):
        for cast, mw in (("none", None), ("hand", "fp32"), ("hand", "kahan"), ("hand", False)):
            for dtype in ("fp16", "bf16"):
                for inner in ("sgd", "adamw_fused"):
                    for overflow in ("none", "inf@2"):
                        if cast == "none" and dtype == "bf16":
                            continue  # a float32 model has no low dtype
                        q = (recipe, mw, overflow, dtype, inner) == QUICK_JOINT
                        add(Case("joint", "fp32" if cast == "none" else dtype, inner, cast=cast,
                                 master_weights=mw, loss_scale="dyn_fast", recipe=recipe,
                                 overflow=overflow, quick=q))  # fmt: skip

    if fused:
        # AdamW(fused=True), bfloat16, no loss scale: the compiled steps, switched on.
        for level, mw, inner in (("O2", "fp32", "adamw_fused"), ("lean", "kahan", "adamw_fused"),
                                 ("O2", "split8", "adamw8bit")):  # fmt: skip
            for overflow in ("none", "inf@2"):
                add(Case("level", "bf16", inner, level=level, master_weights=mw, fused=True,
                         overflow=overflow))  # fmt: skip
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]
    return [c for c in cases if c.quick] if quick else cases


# -- building blocks ------------------------------------------------------------------


#: Where the running case is: "build", then "step N" (a refusal's place is behaviour too).
_STAGE = ["build"]


def _mixprec() -> Any:
    import mixprec  # imported late: --src must reach sys.path first

    return mixprec


def _model(kind: str) -> torch.nn.Module:
    nn = torch.nn
    if kind == "mlp":  # 604 parameters; the first weight spans two of AdamW8bit's blocks
        return nn.Sequential(nn.Linear(8, 40), nn.LayerNorm(40), nn.GELU(), nn.Linear(40, 4))
    # cnn: 228 parameters; BatchNorm's running statistics are state too.
    return nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32, 4),
    )  # fmt: skip


def _batch(kind: str, step: int, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 100 * stream + step)
    x = torch.randn(6, 8, generator=g) if kind == "mlp" else torch.randn(3, 1, 6, 6, generator=g)
    return x, torch.randn(x.shape[0], 4, generator=g)


def _inner(name: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=True)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)
    if name == "adamw_eps":  # an eps float16 state holds
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, foreach=True)
    if name == "adamw8bit":
        return _mixprec().optim.AdamW8bit(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(f"unknown inner optimizer {name!r}")


def _loss_scale(name: str) -> Any:
    mixprec = _mixprec()
    return {
        "none": None,
        "dynamic": "dynamic",
        "static": 128.0,
        # grows every 2 finite steps, so growth and back-off both happen within a run
        "dyn_fast": lambda: mixprec.DynamicLossScale(initial_scale=2.0**8, growth_interval=2),
        "dyn_hysteresis": lambda: mixprec.DynamicLossScale(
            initial_scale=2.0**8, growth_interval=2, hysteresis=2
        ),
    }[name]


def _scale_arg(case: Case) -> dict[str, Any]:
    if case.loss_scale == "default":
        return {}
    value = _loss_scale(case.loss_scale)
    return {"loss_scale": value() if callable(value) else value}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def _poison(model: torch.nn.Module, case: Case, step: int) -> None:
    """Write an inf or NaN into one element of the first gradient, as an overflowing
    backward would (``inf@2``: at step 2; ``nan@0``: at the first step)."""
    value = {"inf@2": (2, math.inf), "nan@0": (0, math.nan)}.get(case.overflow)
    if value is None or value[0] != step:
        return
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    assert grad is not None
    with torch.no_grad():
        grad.view(-1)[0] = value[1]


def _enable_fused(opt: Any) -> None:
    """Switch the compiled fused master-weight step on. Off a GPU no public option does;
    the masters' ``fused`` attribute (``None``: only on a GPU) is what the library's
    own tests and benchmarks set. If the internals move, this is the line to follow."""
    masters = getattr(opt, "_master", None)
    if masters is None or not hasattr(masters, "fused"):
        raise RuntimeError("bit_identity: cannot find the masters' fused switch")
    masters.fused = True


# -- digests --------------------------------------------------------------------------


class _Digest:
    """A SHA-256 over a nested structure: tensors by dtype, shape and raw bytes; dicts
    in key order (sorted: insertion order is not behaviour); other leaves by repr."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def add(self, obj: Any) -> _Digest:
        h = self.h
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"{")
            for key in sorted(obj, key=repr):
                h.update(repr(key).encode() + b":")
                self.add(obj[key])
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[" if isinstance(obj, list) else b"(")
            for item in obj:
                self.add(item)
            h.update(b"]")
        else:
            text = repr(obj)
            if " at 0x" in text:  # an object's address differs between runs
                text = type(obj).__qualname__
            h.update(text.encode())
        h.update(b",")
        return self

    def hex(self) -> str:
        return self.h.hexdigest()


def _digest(obj: Any) -> str:
    return _Digest().add(obj).hex()


def _model_state(*models: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """(every parameter and buffer by name, every parameter's gradient or None)."""
    values: list[tuple[str, torch.Tensor]] = []
    grads: list[tuple[str, torch.Tensor | None]] = []
    for i, model in enumerate(models):
        values += [(f"{i}.{n}", t) for n, t in model.named_parameters()]
        values += [(f"{i}.{n}", t) for n, t in model.named_buffers()]
        grads += [(f"{i}.{n}", p.grad) for n, p in model.named_parameters()]
    return values, grads


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


# -- the runs -------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """What a finished case leaves to be recorded."""

    models: list[torch.nn.Module]
    state: Any  # the optimizer's (or scaler's, release's) state_dict(), all of them
    counters: dict[str, Any]  # loss scale, iterations, skipped steps: readable numbers
    loss: float
    extra: Any = None  # per-step values some APIs return (release's skip counts)


def _build_lso(case: Case) -> tuple[torch.nn.Module, Any]:
    mixprec = _mixprec()
    model = _model(case.model)
    kwargs: dict[str, Any] = dict(case.options)
    if case.master_weights is not None:
        kwargs["master_weights"] = case.master_weights
    if case.api == "level":
        level = case.level or "O0"
        model, opt = mixprec.amp.initialize(
            model, _inner(case.inner, model.parameters()), level=level,
            dtype=DTYPES[case.dtype], **_scale_arg(case), **kwargs,
        )  # fmt: skip
    else:
        if case.cast == "hand":
            model = model.to(DTYPES[case.dtype])
        elif case.cast in ("O2", "O3"):
            model, _ = mixprec.amp.initialize(model, None, level=case.cast,
                                              dtype=DTYPES[case.dtype])  # fmt: skip
        opt = mixprec.LossScaleOptimizer(_inner(case.inner, model.parameters()),
                                         **_scale_arg(case), **kwargs)  # fmt: skip
    if case.fused:
        _enable_fused(opt)
    return model, opt


def _input(case: Case, x: torch.Tensor) -> torch.Tensor:
    # amp levels cast inputs in their hooks; a model cast by hand takes its own dtype.
    return x.to(DTYPES[case.dtype]) if case.cast == "hand" or case.api == "release" else x


def _lso_steps(case: Case, model: torch.nn.Module, opt: Any, steps: range) -> float:
    loss = torch.zeros(())
    for step in steps:
        _STAGE[0] = f"step {step}"
        opt.zero_grad()
        x, y = _batch(case.model, step)
        loss = _loss(model(_input(case, x)), y)
        opt.scale_loss(loss).backward()
        _poison(model, case, step)
        if case.recipe in ("unscale_clip", "unscale_drop"):
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if case.recipe == "unscale_drop" and step == 3:
                opt.zero_grad()  # a spike: the step is dropped after seeing its norm
                continue
        opt.step()
    return float(loss.detach())


def _saved(obj: Any) -> Any:
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    _STAGE[0] = "save and load"  # until the resumed run's first step
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _run_lso(case: Case) -> _Run:
    model, opt = _build_lso(case)
    if case.recipe == "resume":
        _lso_steps(case, model, opt, range(SAVE_AFTER))
        saved = _saved({"model": model.state_dict(), "opt": opt.state_dict()})
        torch.manual_seed(SEED + 1)  # the fresh run's initial weights differ: all comes from saved
        model, opt = _build_lso(case)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        loss = _lso_steps(case, model, opt, range(SAVE_AFTER, STEPS))
    else:
        loss = _lso_steps(case, model, opt, range(STEPS))
    counters = {
        "loss_scale": _number(opt.loss_scale),
        "iterations": _number(opt.iterations),
        "skipped": _number(opt.skipped_steps),
    }
    return _Run([model], opt.state_dict(), counters, loss)


def _run_release(case: Case) -> _Run:
    mixprec = _mixprec()

    def build() -> tuple[torch.nn.Module, Any]:
        model = _model(case.model).to(DTYPES[case.dtype])
        kwargs: dict[str, Any] = dict(case.options)
        if case.master_weights is not None:
            kwargs["master_weights"] = case.master_weights
        kwargs.update(_scale_arg(case))
        return model, mixprec.optim.GradientRelease(
            model, lambda ps: _inner(case.inner, ps), **kwargs
        )

    def steps(model: torch.nn.Module, release: Any, run: range) -> tuple[float, list[int]]:
        loss, skipped = torch.zeros(()), []
        factor = release.loss_scale or 1.0
        for step in run:
            _STAGE[0] = f"step {step}"
            x, y = _batch(case.model, step)
            loss = _loss(model(_input(case, x)), y)
            scaled = loss * factor
            if case.overflow == "inf@2" and step == 2:
                # The gradients are stepped and freed inside backward(): the inf enters
                # through the loss, into the last layer's bias's gradient only.
                last_bias = list(model.parameters())[-1]
                scaled = scaled + last_bias.float().sum() * math.inf
            scaled.backward()
            skipped.append(release.end_step())
        return float(loss.detach()), skipped

    model, release = build()
    if case.recipe == "resume":
        _, skipped = steps(model, release, range(SAVE_AFTER))
        saved = _saved({"model": model.state_dict(), "release": release.state_dict()})
        torch.manual_seed(SEED + 1)
        model, release = build()
        model.load_state_dict(saved["model"])
        release.load_state_dict(saved["release"])
        loss, more = steps(model, release, range(SAVE_AFTER, STEPS))
        skipped += more
    else:
        loss, skipped = steps(model, release, range(STEPS))
    counters = {"skipped": _number(release.skipped_steps)}
    return _Run([model], release.state_dict(), counters, loss, extra=skipped)


def _run_gradscaler(case: Case) -> _Run:
    mixprec = _mixprec()

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = _model(case.model)
        opt = _inner(case.inner, model.parameters())
        if case.loss_scale == "default_args":
            scaler = mixprec.GradScaler("cpu")
        else:  # a scale that grows every 2 finite steps
            scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        return model, opt, scaler

    def steps(model: torch.nn.Module, opt: Any, scaler: Any, run: range) -> float:
        loss = torch.zeros(())
        for step in run:
            _STAGE[0] = f"step {step}"
            opt.zero_grad()
            x, y = _batch(case.model, step)
            with torch.autocast("cpu", dtype=DTYPES[case.dtype]):
                out = model(x)
            loss = _loss(out, y)
            scaler.scale(loss).backward()
            _poison(model, case, step)
            if case.recipe == "unscale_clip":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        return float(loss.detach())

    model, opt, scaler = build()
    if case.recipe == "resume":
        steps(model, opt, scaler, range(SAVE_AFTER))
        saved = _saved({"model": model.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict()})  # fmt: skip
        torch.manual_seed(SEED + 1)
        model, opt, scaler = build()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        scaler.load_state_dict(saved["scaler"])
        loss = steps(model, opt, scaler, range(SAVE_AFTER, STEPS))
    else:
        loss = steps(model, opt, scaler, range(STEPS))
    counters = {"loss_scale": scaler.get_scale()}
    return _Run([model], {"opt": opt.state_dict(), "scaler": scaler.state_dict()}, counters,
                loss)  # fmt: skip


def _run_joint(case: Case) -> _Run:
    mixprec = _mixprec()
    value = _loss_scale(case.loss_scale)
    shared = value() if callable(value) else value
    models, opts = [], []
    for _ in range(2):
        model = _model(case.model)
        if case.cast == "hand":
            model = model.to(DTYPES[case.dtype])
        kwargs = {} if case.master_weights is None else {"master_weights": case.master_weights}
        opts.append(mixprec.LossScaleOptimizer(_inner(case.inner, model.parameters()),
                                               loss_scale=shared, **kwargs))  # fmt: skip
        models.append(model)
    loss = torch.zeros(())
    for step in range(STEPS):
        _STAGE[0] = f"step {step}"
        for i, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            x, y = _batch(case.model, step, stream=i)
            loss = _loss(model(_input(case, x)), y)
            opt.scale_loss(loss).backward()
        _poison(models[1], case, step)  # the second overflows: joint_step skips both
        if case.recipe == "separate":
            for opt in opts:
                opt.step()
        else:
            mixprec.joint_step(*opts)
    counters = {
        "loss_scale": _number(opts[0].loss_scale),
        "iterations": [_number(o.iterations) for o in opts],
        "skipped": [_number(o.skipped_steps) for o in opts],
    }
    return _Run(models, [o.state_dict() for o in opts], counters, float(loss.detach()))


_RUNNERS: dict[str, Callable[[Case], _Run]] = {
    "level": _run_lso,
    "lso": _run_lso,
    "release": _run_release,
    "gradscaler": _run_gradscaler,
    "joint": _run_joint,
}


def run_case(case: Case) -> dict[str, Any]:
    """Train ``case`` from its seed; return its record (digest, parts, readable numbers)."""
    torch.manual_seed(SEED)
    _STAGE[0] = "build"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run = _RUNNERS[case.api](case)
        except Exception as err:  # a refused combination is recorded, not raised
            error = f"error: {type(err).__name__}: {err}"
            return {"digest": _digest([error, _STAGE[0]]), "error": error, "at": _STAGE[0]}
    # The library's own warnings are behaviour; torch's are the same for every build.
    said = [f"{w.category.__name__}: {w.message}" for w in caught
            if "torch" not in Path(w.filename).parts]  # fmt: skip
    values, grads = _model_state(*run.models)
    parts = {
        "params": _digest(values),
        "grads": _digest(grads),
        "optimizer_state": _digest(run.state),
        "counters": _digest([run.counters, run.extra, said]),
    }
    record: dict[str, Any] = {"digest": _digest(parts), **run.counters}
    # The parts' digests only say where a difference is: 64 bits each are plenty.
    record["parts"] = {k: v[:16] for k, v in parts.items()}
    record["loss"] = run.loss if math.isfinite(run.loss) else repr(run.loss)  # JSON: no NaN
    if said:
        record["warnings"] = said
    return record


def machine() -> dict[str, Any]:
    """What floating-point results depend on besides the code."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def run_grid(
    cases: list[Case], log: Callable[[str], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Every case's record, by id, on one thread (the results must not depend on how
    work is split between threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for i, case in enumerate(cases):
            t0 = time.perf_counter()
            results[case.id] = run_case(case)
            if log is not None:
                what = results[case.id].get("error", results[case.id]["digest"][:12])
                log(f"[{i + 1}/{len(cases)}] {time.perf_counter() - t0:6.2f}s {case.id}: {what}")
        return results
    finally:
        torch.set_num_threads(threads)


def dumps(machine_entry: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    """The record as JSON, one case a line (diffs of two records stay readable)."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in results.items()]
    cases = "{\n" + ",\n".join(lines) + "\n}" if lines else "{}"
    return f'{{"machine": {json.dumps(machine_entry, sort_keys=True)},\n"cases": {cases}}}\n'


def compare(
    baseline: dict[str, Any], results: dict[str, dict[str, Any]]
) -> tuple[list[str], list[str], list[str]]:
    """(identical, differing, missing) case ids of ``results`` against ``baseline``'s."""
    recorded = baseline["cases"]
    same, differ, missing = [], [], []
    for case_id, record in results.items():
        if case_id not in recorded:
            missing.append(case_id)
        elif recorded[case_id]["digest"] == record["digest"]:
            same.append(case_id)
        else:
            differ.append(case_id)
    return same, differ, missing


def difference(before: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs in one case, in a line."""
    if "error" in before or "error" in now:
        was = f"{before['error']!r} at {before.get('at')}" if "error" in before else "a run"
        is_ = f"{now['error']!r} at {now.get('at')}" if "error" in now else "a run"
        return f"was {was}, now {is_}"
    parts = [k for k in before["parts"] if before["parts"][k] != now["parts"].get(k)]
    readable = ("loss_scale", "iterations", "skipped", "loss")
    shown = {k: (before.get(k), now.get(k)) for k in readable if before.get(k) != now.get(k)}
    return f"parts {', '.join(parts)}" + (f"; {shown}" if shown else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks bit_identity",
        description="Record or check the bits of a grid of tiny training runs.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--record", metavar="FILE", help="write the records to FILE (JSON)")
    action.add_argument("--check", metavar="FILE", help="compare with the records in FILE")
    parser.add_argument("--quick", action="store_true", help="the quick subset only")
    parser.add_argument(
        "--fused",
        action="store_true",
        help="also the compiled fused master-weight steps (compiling is slow)",
    )
    parser.add_argument("--only", metavar="TEXT",
                        help="only the cases whose id contains TEXT")  # fmt: skip
    parser.add_argument("--src", metavar="DIR",
                        help="import mixprec from DIR (put first on sys.path)")  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per case")
    args = parser.parse_args(argv)
    if args.src:
        if "mixprec" in sys.modules:
            parser.error("--src: mixprec is already imported in this process")
        sys.path.insert(0, str(Path(args.src).resolve()))
    mixprec = _mixprec()
    print(f"mixprec {mixprec.__version__} from {Path(mixprec.__file__).parent}", file=sys.stderr)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    cases = grid(quick=args.quick, fused=args.fused)
    if args.only:
        cases = [c for c in cases if args.only in c.id]
    t0 = time.perf_counter()
    results = run_grid(cases, log if args.verbose else None)
    elapsed = time.perf_counter() - t0
    errors = sum("error" in r for r in results.values())
    log(f"{len(results)} cases ({errors} refused) in {elapsed:.1f} s")
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(dumps(machine(), results))
        log(f"recorded {args.record}")
        return 0
    baseline = json.loads(Path(args.check).read_text())
    if baseline.get("machine") != machine():
        log(f"note: recorded on {baseline.get('machine')}, checked on {machine()}: "
            "floating-point results may differ for that reason alone")  # fmt: skip
    same, differ, missing = compare(baseline, results)
    print(f"{len(same)} identical, {len(differ)} differ, {len(missing)} missing")
    for case_id in differ:
        print(f"  differs: {case_id}: {difference(baseline['cases'][case_id], results[case_id])}")
    for case_id in missing:
        print(f"  missing: {case_id} (not in the record)")
    not_run = len(set(baseline["cases"]) - set(results))
    if not_run:
        print(f"({not_run} recorded cases not selected by this run's options)")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
