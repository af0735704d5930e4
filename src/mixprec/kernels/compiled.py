"""The step bodies of :mod:`mixprec.kernels.adamw` through ``torch.compile``.

One compiled function per body, made once per process: each parameter's tensors are
read once and written once, in one loop per parameter, side by side in a few
launches on a GPU (inductor's combo kernels).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.hooks import RemovableHandle

from mixprec.kernels.adamw import (
    LOW_BITS8_MOMENTS8,
    _advance_apart,
    _steps_in_loop,
    masters_adamw_math_,
    split8_adamw8bit_math_,
    update_chunk,
)

#: Per-parameter loops that inductor puts in one launch (its combo kernels; 8 unless
#: told). A loop takes about 9 kernel arguments, well within the 250 a launch may have.
COMBO_NODES = 16


def _eager_math(mode: str) -> Any:
    """The eager function of ``mode``'s step (its own reference)."""
    return split8_adamw8bit_math_ if mode == LOW_BITS8_MOMENTS8 else masters_adamw_math_



#: Inductor's limits past which a value read by several loops is kept in a buffer.
_REALIZE_THRESHOLDS = ("realize_reads_threshold", "realize_opcount_threshold",
                       "realize_acc_reads_threshold", "realize_cpu_opcount_threshold",
                       "realize_cpu_acc_reads_threshold")  # fmt: skip


@functools.cache
def _compiled(mode: str) -> Any:
    """The process's compiled step of ``mode`` (:func:`compile_math`, made once)."""
    return compile_math(mode)


def compile_math(mode: str, cpu_min_chunk: int = 16384) -> Any:
    """``mode``'s elementwise math through ``torch.compile``, a fresh compiled function
    with a code object of its own (no graphs yet), called with the math's arguments.

    On a CPU, a loop of the compiled step runs on several threads only where each
    thread gets at least ``cpu_min_chunk`` elements (inductor's default: 512). A
    parallel region costs a wake-up of the other threads, which, when they sleep
    between regions (OpenMP's passive waiting, or cores shared with other jobs), is
    about 50-100 us: the fused O2 step of a 31-tensor model of 69K parameters, each
    loop its own region, took 2.8 ms that way and takes 1.3 with the default. ATen's
    own elementwise ops split only past 32,768 elements (its grain size), so two
    threads share a loop where they would share the eager ops."""
    # One graph per list layout (count, shapes, dtypes): a model's step compiles once.
    # Each mode gets its own copy of the function's code: dynamo keeps its graphs, and
    # counts them against its recompile limit, per code object, and tries them in turn
    # on every call. Combo kernels put the parameters' loops side by side in a few
    # launches on a GPU. Emulated precision casts: inductor otherwise keeps float32
    # through a round trip to bfloat16, and the compensation, total - float(round(total)),
    # would be lost. No size asserts: the graph is static, so dynamo's guards have
    # checked every input's sizes and strides before the call, and the generated code
    # would check them again, one call per input, six per parameter (150 us a step on a
    # CPU for a 30-tensor model, a tenth of its step).
    eager = _eager_math(mode)
    code = eager.__code__.replace(co_name=f"_lean_adamw_{mode.replace('-', '_')}")
    math = types.FunctionType(code, eager.__globals__, code.co_name, eager.__defaults__)
    options: dict[str, Any] = {"combo_kernels": True, "combo_kernel_max_num_nodes": COMBO_NODES,
                               "emulate_precision_casts": True, "size_asserts": False,
                               "cpp.min_chunk_size": cpu_min_chunk}  # fmt: skip
    if mode == LOW_BITS8_MOMENTS8:
        # Recompute, never store: left to its thresholds, inductor keeps the decoded
        # moments, the update and the hash's index in parameter-sized buffers (they feed
        # the block maxima and then the codes), about 20 bytes per parameter of the
        # largest tensor at the step's peak, and three more passes over memory.
        options.update(dict.fromkeys(_REALIZE_THRESHOLDS, 2**31 - 1))
    return torch.compile(math, fullgraph=True, dynamic=False, options=options)


#: Graphs a mode may compile (one per model layout stepped in the process) once
#: dynamo's own recompile limit (8) is reached: past it, ``fullgraph=True`` would fail.
RECOMPILE_LIMIT = 256



def _run_compiled(mode: str, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The compiled math; a layout past dynamo's recompile limit (a process that steps
    many models) compiles under a higher one. The limit is hit before anything runs."""
    compiled = _compiled(mode)
    try:
        return compiled(mode, *args, **kwargs)
    except Exception as err:
        # Looked up here, not at import: importing dynamo takes seconds, and a process
        # that never compiles (the command line's input checks) should not pay them.
        if not isinstance(err, getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())):
            raise
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(mode, *args, **kwargs)


# An OrderedDict: RemovableHandle keeps a weak reference to it (a dict takes none).
_WATCH_HOOKS: OrderedDict[int, Callable[[str, tuple], contextlib.AbstractContextManager]] = (
    OrderedDict()
)


def register_watch_hook(
    hook: Callable[[str, tuple], contextlib.AbstractContextManager],
) -> RemovableHandle:
    """Run ``hook(mode, args)`` (a context manager) around each call of a compiled step
    body that a ``TorchDispatchMode`` watches (:func:`lean_adamw_fused_` then runs the
    eager body in its place). An op counter prices the call as the one compiled kernel it
    stands for, from its arguments, instead of as the eager ops it sees; returns a handle
    whose ``remove()`` takes the hook away.

    >>> import contextlib
    >>> handle = register_watch_hook(lambda mode, args: contextlib.nullcontext())
    >>> handle.remove()
    """
    handle = RemovableHandle(_WATCH_HOOKS)
    _WATCH_HOOKS[handle.id] = hook
    return handle


def lean_adamw_fused_(mode: str, *args: Any) -> torch.Tensor:
    """:func:`~mixprec.kernels.adamw.kahan_adamw_` (``mode``
    :data:`~mixprec.kernels.adamw.COMPENSATED`), stochastic rounding, 8 low bits,
    float32 masters' step (:func:`masters_adamw_math_`) or 8 low bits with
    ``AdamW8bit``'s moments (:func:`split8_adamw8bit_math_`): the formats of
    :mod:`mixprec.kernels.adamw`,
    same arguments after ``mode``, with the elementwise math through ``torch.compile``:
    one loop per parameter that reads and writes each tensor once, side by side in a
    few launches on a GPU (inductor's combo kernels). Under a ``TorchDispatchMode``
    (a FLOP counter, a debugging mode) the eager math runs, as ``torch.compile``
    itself would, so the mode sees the step's ops; a profiler sees the step as
    ``mixprec.lean_adamw``; hooks of :func:`register_watch_hook` run around the eager
    math. A ``found_inf`` of ``None`` has the step check the gradients
    itself (:func:`_gradients_nonfinite`, in the same graph). Returns the verdict the
    step went by, ``found_inf`` or its own."""
    steps = args[5]  # (weights, extras, grads, m, v, steps, kept, hypers, found_inf)
    # The range costs microseconds to open even when no profiler listens: a tenth of
    # a small model's compiled step on a CPU.
    named = (torch.profiler.record_function("mixprec.lean_adamw")
             if torch.autograd._profiler_enabled() else contextlib.nullcontext())  # fmt: skip
    in_loop = _steps_in_loop(args[0], mode)
    with named:
        if _get_current_dispatch_mode() is not None:
            with contextlib.ExitStack() as watched:
                for hook in list(_WATCH_HOOKS.values()):
                    watched.enter_context(hook(mode, args))
                found_inf, *_ = _eager_math(mode)(mode, *args, steps_in_loop=in_loop)
        else:
            found_inf, *_ = _run_compiled(mode, *args, steps_in_loop=in_loop)
        _advance_apart(args[0], steps, found_inf, mode)
    return found_inf


@functools.cache
def _compiled_update() -> Any:
    # One compile per process; torch keeps one cache per function whatever the wrapper.
    return torch.compile(update_chunk, fullgraph=True, dynamic=True)


def update_chunk_fused(
    grads: torch.Tensor,
    *args: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`update_chunk` (same arguments) through ``torch.compile``: one graph, its
    elementwise ops fused into a few kernels. Its results are the reference's up to the
    rounding of reordered float32 operations (see the module docstring).

    A graph is compiled per rounding mode (noise or ``None``), zero or nonzero
    ``weight_decay`` and device, not per chunk or step: the chunk's sizes are unbacked
    symbols (so size 1 does not get a graph of its own, as with dynamic shapes), the
    hyperparameters are tensors (a Python float passed on to an op would be a
    constant: every new learning rate, or beta under ``OneCycleLR``, would compile
    again) and a missing ``grad_scale``/``found_inf`` is passed as 1/0, which compute
    the same. ``weight_decay`` stays a number: it picks the graph, its value is an
    input (multiplied by the learning rate)."""
    from torch._dynamo.decorators import mark_unbacked

    *tensors, grad_scale, found_inf = (grads, *args)
    if not torch.compiler.is_compiling():  # in a caller's graph, it is traced inline
        for t in tensors:
            if t is not None:
                mark_unbacked(t, 0)
    device = grads.device
    grad_scale = torch.ones((), device=device) if grad_scale is None else grad_scale
    found_inf = torch.zeros((), device=device) if found_inf is None else found_inf
    # Filled on the device (the number is a kernel argument): a copy from the host
    # could wait for the GPU. float64, as the numbers' own arithmetic is.
    lr_, beta1_, beta2_, eps_ = (torch.full((), x, dtype=torch.float64, device=device)
                                 for x in (lr, beta1, beta2, eps))  # fmt: skip
    return _compiled_update()(
        *tensors, grad_scale, found_inf, lr=lr_, beta1=beta1_, beta2=beta2_, eps=eps_,
        decay=decay,
    )  # fmt: skip


def compile_unsupported(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run the step on ``device_type`` here, or ``None``."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported with this Python and torch {torch.__version__}"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():  # inductor writes its GPU kernels in Triton
            return "torch.compile needs Triton for CUDA, and it is not installed"
    return None
