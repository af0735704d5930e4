"""The lean master-weight modes' AdamW step as one compiled elementwise function.

The eager ``"kahan"`` step (:class:`~mixprec.optim._lean.LeanUpdates`) runs the inner
optimizer on the compensation buffers, then rounds in float32; the eager ``"split8"``
step (:class:`~mixprec.optim.Split8MasterWeights`) rebuilds float32 masters and their
gradients, runs the inner optimizer on them and splits them again. Both are separate
kernels around float32 tensors held in memory: about 38 and 75 bytes moved per
bfloat16 parameter with AdamW. :func:`kahan_adamw_` and :func:`split8_adamw_` are the
same steps written as one pure elementwise function of each parameter's tensors:
AdamW's update (torch's arithmetic), decoupled decay folded in, the rounding and the
split, and the skip on ``found_inf``. Compiled (:func:`lean_adamw_fused_`), each
tensor is read once and written once: 18 bytes per bfloat16 parameter for kahan
(weight, compensation, gradient and bfloat16 moments: 10 read, 8 written), 24 for
split8 (weight, int8 correction, gradient, float32 moments: 13 read, 11 written).
Float32 masters (``mode="fp32"``, O2's ``master_weights="fp32"``) step the same way:
the master and its moments read and written, the model's gradient read and its
rounded weight written, 28 bytes per bfloat16 parameter, with no float32 master
gradient in memory (the eager O2 step copies the gradients into one, checks them,
steps and copies back: about 40 bytes and 4 more per parameter at its peak).

Each function is its own eager reference. The kahan one differs from the eager lean
step in one rounding: the eager step rounds ``c - update`` to bfloat16 (the inner
optimizer writes its update into the bfloat16 buffer) before adding the decayed
weight; here ``weight * kept + c - update`` is formed in float32 and rounded once, so
the split keeps more of each update. The split8 one does the eager step's arithmetic
on the same values, except that decoupled decay from both the inner optimizer and
the wrapper is one factor (``1 - lr * (a + b)``, not ``(1 - lr * a)(1 - lr * b)``).
Compiled and eager runs agree up to the rounding of reordered float32 operations
(inductor may fuse a multiply and an add into one FMA), and the skip and the step
counts are exact either way. The state is the inner ``AdamW``'s own, so checkpoints
move freely between the fused and the eager steps.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from torch.optim import optimizer as optimizer_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mixprec.numerics import any_nonfinite
from mixprec.optim import _compressed_adamw as q8
from mixprec.optim._split8 import _split8_codes, join8_bits

__all__ = ["kahan_adamw_", "split8_adamw_", "lean_adamw_fused_", "fused_adamw_unsupported",
           "wants_fused", "fused_adamw_step", "HyperVectors", "HYPER_NAMES",
           "COMBO_NODES", "hashed_bits", "compile_math"]  # fmt: skip

#: The order of a group's hyperparameters in the float64 vector :func:`kahan_adamw_` reads.
HYPER_NAMES = ("lr", "beta1", "beta2", "eps")

#: Per-parameter loops that inductor puts in one launch (its combo kernels; 8 unless
#: told). A loop takes about 9 kernel arguments, well within the 250 a launch may have.
COMBO_NODES = 16


def kahan_adamw_(
    weights: list[torch.Tensor],
    compensations: list[torch.Tensor | None],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    kept: list[torch.Tensor | None],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor,
    maximize: bool = False,
) -> None:
    """One AdamW step with Kahan-compensated low-precision weights, in place.

    For each parameter ``i``: ``weights[i]`` (bfloat16 or float16, or float32 for a
    parameter kept in float32, whose ``compensations[i]`` is ``None``), its gradient,
    torch AdamW's state (``exp_avg``, ``exp_avg_sq`` in the weight's dtype, the
    float32 0-dim ``step``), ``kept[i]`` what decoupled decay keeps (``1 - lr * decay``,
    a 1-element float32 tensor, or ``None``: no decay) and ``hypers[i]`` its group's
    float64 vector of :data:`HYPER_NAMES`. A nonzero ``found_inf`` (float32, 0-dim) leaves everything as
    it was. In float32, with ``t = step + 1``::

        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        update = lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
        total = w * kept + c - update
        w = round(total);  c = round(total - w)      # float32 weights: w = total

    >>> w = torch.ones(4, dtype=torch.bfloat16); c = torch.zeros_like(w)
    >>> m, v, step = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    >>> hyper = torch.tensor([2.0**-10, 0.9, 0.999, 1e-8], dtype=torch.float64)
    >>> g = torch.full_like(w, -1.0)  # each update is 2**-10: rounds away in bfloat16 at 1.0
    >>> kahan_adamw_([w], [c], [g], [m], [v], [step], [torch.ones(1)], [hyper], torch.zeros(()))
    >>> float(w[0]), float(c[0]), float(step)  # the update is kept in the compensation
    (1.0, 0.0009765625, 1.0)

    The step counts advance in one foreach op after the elementwise math (a count is
    one number: a loop of its own would be one more launch per parameter), or on a CPU
    in it (:data:`CPU_STEPS_IN_LOOP`).
    """
    _lean_adamw_math_("kahan", weights, compensations, grads, exp_avgs, exp_avg_sqs, steps,
                      kept, hypers, found_inf, maximize)  # fmt: skip
    _advance_apart(weights, steps, found_inf, "kahan")


def split8_adamw_(
    weights: list[torch.Tensor],
    corrections: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    kept: list[torch.Tensor | None],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor,
    maximize: bool = False,
) -> None:
    """One AdamW step of ``"split8"`` masters, in place, without materialising them:
    the arguments of :func:`kahan_adamw_`, with each bfloat16 weight's int8
    ``corrections[i]`` (:func:`~mixprec.optim._split8.split8_bits`) in place of the
    compensation and float32 moments (the masters' state)::

        master = join8(w, q);  master = master * kept - update   # AdamW, in float32
        w = round(master);     q = split8(master, w)

    >>> from mixprec.optim._split8 import join8_bits
    >>> w = torch.ones(4, dtype=torch.bfloat16); q = torch.zeros(4, dtype=torch.int8)
    >>> m, v, step = torch.zeros(4), torch.zeros(4), torch.zeros(())
    >>> hyper = torch.tensor([2.0**-10, 0.9, 0.999, 1e-8], dtype=torch.float64)
    >>> g = torch.full((4,), -1.0, dtype=torch.bfloat16)
    >>> split8_adamw_([w], [q], [g], [m], [v], [step], [torch.ones(1)], [hyper], torch.zeros(()))
    >>> float(w[0]), round(float(join8_bits(w, q)[0]) - 1, 5)  # kept in the correction
    (1.0, 0.00098)
    """
    _lean_adamw_math_("split8", weights, corrections, grads, exp_avgs, exp_avg_sqs, steps,
                      kept, hypers, found_inf, maximize)  # fmt: skip
    _advance_apart(weights, steps, found_inf, "split8")


def _lean_adamw_math_(
    mode: str,
    weights: list[torch.Tensor],
    extras: list[Any],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    kept: list[torch.Tensor | None],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    maximize: bool = False,
) -> list[torch.Tensor]:
    """:func:`kahan_adamw_` (``mode="kahan"``, ``extras`` the compensations) or
    :func:`split8_adamw_` (``"split8"``, the corrections), advancing ``steps`` only on
    a CPU (:data:`CPU_STEPS_IN_LOOP`; elsewhere it reads them, and they advance apart):
    the part that compiles into one loop per parameter.

    ``mode="stochastic"`` rounds ``w * kept - update`` stochastically into the bfloat16
    weight (as :func:`~mixprec.optim._lean.stochastic_round`, with the noise of
    :func:`hashed_bits`); ``extras`` hold the step's int64 seed (``None`` for a float32
    parameter).

    ``mode="fp32"`` is float32 masters' step (``master_weights="fp32"``): ``weights``
    are the masters, ``extras`` the model's low-precision weights (``None`` where the
    parameter is its own master), written and never read, and ``grads`` the model's
    own gradients, widened in the loop, so no float32 master gradient exists::

        master = master * kept - update;  weight = round(master)

    A skipped step writes back ``round(master)``, which is the weight already (the
    masters adopt every edit of the model before the step).

    ``found_inf`` ``None`` checks the gradients here (:func:`_gradients_nonfinite`):
    the step is skipped if any holds an inf or NaN. Returns the verdict (``found_inf``
    or the check's), then on a CPU the bias corrections (see :func:`_kept_on_cpu`)."""
    if found_inf is None:
        found_inf = _gradients_nonfinite(grads)
    applied = 1.0 - found_inf
    skip = found_inf != 0
    in_loop = _steps_in_loop(weights, mode)
    corrections: list[torch.Tensor] = []
    for i, (w, g, m, v, step) in enumerate(zip(weights, grads, exp_avgs, exp_avg_sqs, steps)):
        extra = extras[i]
        lr, beta1, beta2, eps = hypers[i].unbind()
        g32 = -g.float() if maximize else g.float()
        m32 = m.float() * beta1 + g32 * (1 - beta1)
        v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
        t = step + applied
        step_size, root2 = _bias_corrections(lr, beta1, beta2, t, corrections)
        update = m32 / (v32.sqrt() / root2 + eps) * step_size
        split8 = mode == "split8" and extra is not None
        start = join8_bits(w, extra) if split8 else w.float()
        keep = kept[i]  # None: no decay, and no multiply by one in the loop
        if keep is not None:
            start = start * keep.reshape(())  # 0-dim: a 0-dim weight stays so
        total = start - update
        if mode == "fp32" and extra is not None:
            total = torch.where(skip, w, total)
            w.copy_(total)
            extra.copy_(total.to(extra.dtype))
        elif mode == "stochastic" and extra is not None:
            bits = total.view(torch.int32) + hashed_bits(extra, i, w.shape, w.device)
            rounded = bits.bitwise_and(-65536).view(torch.float32).to(w.dtype)  # 0xFFFF0000
            w.copy_(torch.where(skip, w, rounded))
        elif split8:
            rounded = total.to(w.dtype)
            extra.copy_(torch.where(skip, extra.float(), _split8_codes(total, rounded)))
            w.copy_(torch.where(skip, w, rounded))
        elif extra is not None:
            total = total + extra.float()
            rounded = total.to(w.dtype)
            extra.copy_(torch.where(skip, extra, (total - rounded.float()).to(extra.dtype)))
            w.copy_(torch.where(skip, w, rounded))
        else:
            w.copy_(torch.where(skip, w, total.to(w.dtype)))
        m.copy_(torch.where(skip, m, m32.to(m.dtype)))
        v.copy_(torch.where(skip, v, v32.to(v.dtype)))
        if in_loop:
            step.copy_(t)
    return [found_inf, *_kept_on_cpu(weights, corrections)]


def _split8_adamw8bit_math_(
    mode: str,
    weights: list[torch.Tensor],
    extras: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    grads: list[torch.Tensor],
    exp_avgs: list[tuple[torch.Tensor, torch.Tensor]],
    exp_avg_sqs: list[tuple[torch.Tensor, torch.Tensor]],
    steps: list[torch.Tensor],
    kept: list[torch.Tensor | None],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    maximize: bool = False,
) -> list[torch.Tensor]:
    """``mode="split8-8bit"``: ``"split8"`` masters stepped by
    :class:`~mixprec.optim.AdamW8bit`, in place, neither the float32 masters nor the
    float32 moments materialised: :func:`_lean_adamw_math_`'s arguments, with
    ``extras[i]`` the pair (int8 correction or ``None`` for a float32 parameter, the
    step's int64 seed or ``None`` for round-to-nearest codes) and ``exp_avgs[i]``,
    ``exp_avg_sqs[i]`` each the pair (codes, float32 block scales) of AdamW8bit's state.
    Per parameter, in float32 (the gradient zero-padded to whole blocks, as AdamW8bit
    pads it)::

        m = decode(m_codes) * beta1 + (1 - beta1) * g    # and v: AdamW8bit's format
        master = join8(w, q) * kept - AdamW's update(m, v)
        w = round(master);  q = split8(master, w);  codes, scales = encode(m), encode(v)

    The codes are rounded stochastically with the 31 bits of :func:`hashed_bits` per
    element (:func:`~mixprec.optim._compressed_adamw.noise_from_bits` splits them between
    the two moments), where the eager ``AdamW8bit`` step draws them from its generator;
    the rest is its arithmetic (:func:`~mixprec.optim._compressed_adamw.update_chunk`).
    Codes are picked while still float32 on a skipped step (whole numbers, the same
    either way; a blend of int8 codes compiles to ten times the cost). ``found_inf``
    ``None``, the step counts and the result as :func:`_lean_adamw_math_`'s."""
    if found_inf is None:
        found_inf = _gradients_nonfinite(grads)
    applied = 1.0 - found_inf
    skip = found_inf != 0
    corrections: list[torch.Tensor] = []
    for i, (w, g, (mq, ms), (vq, vs), step) in enumerate(
        zip(weights, grads, exp_avgs, exp_avg_sqs, steps)
    ):
        correction, seed = extras[i]
        lr, beta1, beta2, eps = hypers[i].unbind()
        block = mq.numel() // ms.numel()
        g32 = -g.float() if maximize else g.float()
        # The padding's gradient is zero, so it never reaches a block's scale.
        g32 = torch.nn.functional.pad(g32.flatten(), (0, mq.numel() - g.numel())).view(-1, block)
        m_codes, v_codes = mq.view(-1, block), vq.view(-1, block)
        m32 = q8.dequantize_first_moment(m_codes, ms) * beta1 + g32 * (1 - beta1)
        v32 = q8.dequantize_second_moment(v_codes, vs) * beta2 + g32 * g32 * (1 - beta2)
        t = step + applied
        step_size, root2 = _bias_corrections(lr, beta1, beta2, t, corrections)
        update = m32 / (v32.sqrt() / root2 + eps) * step_size
        noise_m = noise_v = None
        if seed is not None:
            noise_m, noise_v = q8.noise_from_bits(
                hashed_bits(seed, i, m32.shape, m32.device, bits=31))  # fmt: skip
        new_m_codes, new_m_scales = q8._first_moment_codes(m32, noise_m)
        new_v_codes, new_v_scales = q8._second_moment_codes(v32, noise_v)
        if w.is_contiguous() and (correction is None or correction.is_contiguous()):
            # Flat, as the blocks are: a 2-D weight's own loop would run over its rows
            # beside the blocks' (twice the time on a CPU for a (131072, 16) weight).
            w = w.view(-1)
            correction = None if correction is None else correction.view(-1)
        start = w.float() if correction is None else join8_bits(w, correction)
        keep = kept[i]
        if keep is not None:
            start = start * keep.reshape(())
        total = start - update.flatten()[: w.numel()].view(w.shape)
        rounded = total.to(w.dtype)
        if correction is not None:
            correction.copy_(torch.where(skip, correction.float(), _split8_codes(total, rounded)))
        w.copy_(torch.where(skip, w, rounded))
        m_codes.copy_(torch.where(skip, m_codes.float(), new_m_codes))
        v_codes.copy_(torch.where(skip, v_codes.float(), new_v_codes))
        ms.copy_(torch.where(skip, ms, new_m_scales))
        vs.copy_(torch.where(skip, vs, new_v_scales))
    return [found_inf, *_kept_on_cpu(weights, corrections)]


def _bias_corrections(
    lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor, t: torch.Tensor,
    corrections: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's step size ``lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)`` (0-dim,
    float64: torch's arithmetic), appended to ``corrections`` too (see :func:`_kept_on_cpu`)."""
    step_size, root2 = lr / (1 - beta1**t), (1 - beta2**t).sqrt()
    corrections += [step_size, root2]
    return step_size, root2


#: On a CPU the kahan, stochastic, split8 and float32-master step functions advance
#: each parameter's step count themselves, in the compiled loop (one number stored).
#: Apart from it, ``torch._foreach_add_`` with a tensor operand takes its per-tensor
#: path on a CPU, a cast and an add per count: about 60 us a step for a 31-tensor model,
#: a twentieth of its compiled step. Not the split8 + ``AdamW8bit`` step: there one more
#: written input made inductor write the codes and corrections into buffers and copy
#: them out (12 loops for two parameters instead of 7). On a GPU a count advanced in
#: the graph would be a kernel of its own, so one foreach launch after the call advances
#: them all. The step-cost benchmark, which prices a CPU run as a GPU one, turns this
#: off while it counts.
CPU_STEPS_IN_LOOP = True


def _steps_in_loop(weights: list[torch.Tensor], mode: str) -> bool:
    """Whether ``mode``'s step function advances the step counts of ``weights`` (one
    device)."""
    return (CPU_STEPS_IN_LOOP and mode != "split8-8bit" and bool(weights)
            and weights[0].device.type == "cpu")  # fmt: skip


def _advance_apart(weights: list[torch.Tensor], steps: list[torch.Tensor],
                   found_inf: torch.Tensor, mode: str) -> None:  # fmt: skip
    """Advance ``steps`` by one unless ``found_inf``, where ``mode``'s step function did not."""
    if not _steps_in_loop(weights, mode):
        torch._foreach_add_(steps, 1.0 - found_inf)


def _gradients_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """1.0 if any element of ``grads`` is inf or NaN, else 0.0 (float32, 0-dim): the
    largest magnitude of each (NaN propagates), then of them all. Inside the compiled
    step a reduction per gradient that runs before anything is written, where a check
    apart from it would be several more kernels and host work (on a CPU, a norm call
    per tensor).

    >>> _gradients_nonfinite([torch.ones(3), torch.tensor([float("nan")])])
    tensor(1.)
    """
    present = [g for g in grads if g.numel()]
    if not present:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device)
    peak = torch.stack([g.abs().amax().float() for g in present]).amax()
    return torch.logical_not(peak < float("inf")).float()  # NaN < inf is False


def _kept_on_cpu(
    weights: list[torch.Tensor], corrections: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The bias corrections on a CPU, nothing elsewhere (the step functions return them).

    A compiled function's outputs are kept in memory, so inductor computes each
    parameter's corrections once, where it would otherwise inline the two float64
    powers into every vector of the parameter's loop: with errno-preserving libm a C
    compiler cannot hoist them, and they were half of the kahan loop's time on a CPU.
    On a GPU each kept number would be a kernel of its own (launches), and a Triton
    program computes them beside its loads."""
    on_cpu = bool(weights) and weights[0].device.type == "cpu"
    return corrections if on_cpu else []


_MASK32 = 0xFFFFFFFF


def _times32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``x * factor`` modulo ``2**32`` for int64 ``x`` in ``[0, 2**32)``, in one product
    below ``2**63`` (an int64 overflow would be undefined): a factor of ``2**31`` or more
    is ``-(2**32 - factor)`` modulo ``2**32``."""
    if factor < 2**31:
        return (x * factor) & _MASK32
    return -(x * (2**32 - factor)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" mixer: xor-shifts and two odd multipliers,
    a bijection whose output bits each depend on every input bit), on int64 holding 32 bits."""
    x = x ^ (x >> 16)
    x = _times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hashed_bits(
    seed: torch.Tensor, stream: int, shape: torch.Size, device: torch.device, bits: int = 16
) -> torch.Tensor:
    """``bits`` random bits (1 to 31) per element of a tensor of ``shape`` (int32 in
    ``[0, 2**bits)``), a pure function of the int64 ``seed`` (a 1-element tensor, drawn
    once a step from the optimizer's generator), the parameter's number ``stream`` in
    the step and the element's index: ``mix(mix(index) ^ mix(seed + stream * golden))``,
    its high ``bits`` bits. Counter-based, so a compiled loop computes it in registers
    (no noise tensor is written or read) and the eager run gives the same bits.

    >>> seed = torch.tensor([7])
    >>> a = hashed_bits(seed, 0, torch.Size([4]), torch.device("cpu"))
    >>> torch.equal(a, hashed_bits(seed, 0, torch.Size([4]), torch.device("cpu")))
    True
    >>> bool(a.ge(0).all() and a.lt(2**16).all())
    True
    >>> torch.equal(hashed_bits(seed, 0, torch.Size([4]), torch.device("cpu"), bits=31) >> 15, a)
    True
    """
    key = _mix32((seed + stream * 0x9E3779B9) & _MASK32)
    index = torch.arange(shape.numel(), dtype=torch.int64, device=device)
    return (_mix32(_mix32(index) ^ key) >> (32 - bits)).to(torch.int32).view(shape)


def _eager_math(mode: str) -> Any:
    """The eager function of ``mode``'s step (its own reference)."""
    return _split8_adamw8bit_math_ if mode == "split8-8bit" else _lean_adamw_math_


#: On a CPU, a loop of the compiled step runs on several threads only where each thread
#: gets at least this many elements (inductor's default: 512). A parallel region costs
#: a wake-up of the other threads, which, when they sleep between regions (OpenMP's
#: passive waiting, or cores shared with other jobs), is about 50-100 us: the fused O2
#: step of a 31-tensor model of 69K parameters, each loop its own region, took 2.8 ms
#: that way and takes 1.3 now. ATen's own elementwise ops split only past 32,768
#: elements (its grain size), so two threads share a loop where they would share the
#: eager ops. With idle, busy-waiting threads the difference is within the noise.
CPU_MIN_CHUNK = 16384

#: Inductor's limits past which a value read by several loops is kept in a buffer.
_REALIZE_THRESHOLDS = ("realize_reads_threshold", "realize_opcount_threshold",
                       "realize_acc_reads_threshold", "realize_cpu_opcount_threshold",
                       "realize_cpu_acc_reads_threshold")  # fmt: skip


@functools.cache
def _compiled(mode: str) -> Any:
    """The process's compiled step of ``mode`` (:func:`compile_math`, made once)."""
    return compile_math(mode)


def compile_math(mode: str) -> Any:
    """``mode``'s elementwise math through ``torch.compile``, a fresh compiled function
    with a code object of its own (no graphs yet), called with the math's arguments."""
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
                               "cpp.min_chunk_size": CPU_MIN_CHUNK}  # fmt: skip
    if mode == "split8-8bit":
        # Recompute, never store: left to its thresholds, inductor keeps the decoded
        # moments, the update and the hash's index in parameter-sized buffers (they feed
        # the block maxima and then the codes), about 20 bytes per parameter of the
        # largest tensor at the step's peak, and three more passes over memory.
        options.update(dict.fromkeys(_REALIZE_THRESHOLDS, 2**31 - 1))
    return torch.compile(math, fullgraph=True, dynamic=False, options=options)


#: Graphs a mode may compile (one per model layout stepped in the process) once
#: dynamo's own recompile limit (8) is reached: past it, ``fullgraph=True`` would fail.
RECOMPILE_LIMIT = 256

_LIMIT_HIT: Any = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


def _run_compiled(mode: str, *args: Any) -> list[torch.Tensor]:
    """The compiled math; a layout past dynamo's recompile limit (a process that steps
    many models) compiles under a higher one. The limit is hit before anything runs."""
    compiled = _compiled(mode)
    try:
        return compiled(mode, *args)
    except _LIMIT_HIT:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(mode, *args)


def lean_adamw_fused_(mode: str, *args: Any) -> torch.Tensor:
    """:func:`kahan_adamw_` (``mode="kahan"``), :func:`split8_adamw_` (``"split8"``),
    float32 masters' step (``"fp32"``: :func:`_lean_adamw_math_`) or ``"split8"``
    masters with ``AdamW8bit`` (``"split8-8bit"``: :func:`_split8_adamw8bit_math_`),
    same arguments after ``mode``, with the elementwise math through ``torch.compile``:
    one loop per parameter that reads and writes each tensor once, side by side in a
    few launches on a GPU (inductor's combo kernels). Under a ``TorchDispatchMode``
    (a FLOP counter, a debugging mode) the eager math runs, as ``torch.compile``
    itself would, so the mode sees the step's ops; a profiler sees the step as
    ``mixprec.lean_adamw``. A ``found_inf`` of ``None`` has the step check the gradients
    itself (:func:`_gradients_nonfinite`, in the same graph). Returns the verdict the
    step went by, ``found_inf`` or its own."""
    steps = args[5]  # (weights, extras, grads, m, v, steps, kept, hypers, found_inf)
    # The range costs microseconds to open even when no profiler listens: a tenth of
    # a small model's compiled step on a CPU.
    named = (torch.profiler.record_function("mixprec.lean_adamw")
             if torch.autograd._profiler_enabled() else contextlib.nullcontext())  # fmt: skip
    with named:
        if _get_current_dispatch_mode() is not None:
            found_inf, *_ = _eager_math(mode)(mode, *args)
        else:
            found_inf, *_ = _run_compiled(mode, *args)
        _advance_apart(args[0], steps, found_inf, mode)
    return found_inf


def wants_fused(optimizer: torch.optim.Optimizer, fused: bool | None, mode: str) -> bool:
    """Whether a lean mode steps ``optimizer`` with :func:`lean_adamw_fused_` in
    ``mode``: never for ``fused=False``; for ``True`` whenever the optimizer is one it
    can run; for ``None`` (the default) when, besides, the optimizer asked for a fused
    step (every group of torch's AdamW ``fused=True``; ``AdamW8bit`` not
    ``fused=False``) and the parameters are on a GPU where ``torch.compile`` runs.
    Never while the optimizer has step hooks (the fused step does not call its
    ``step()``, and hooks must run). Checked every step: hooks and groups can change."""
    if fused is False:
        return False
    asked = (optimizer.fused is not False if isinstance(optimizer, q8.AdamW8bit)
             else all(g.get("fused") for g in optimizer.param_groups))  # fmt: skip
    if fused is None and not (  # the default: cheap checks first, as this runs every step
        asked
        and {p.device.type for g in optimizer.param_groups for p in g["params"]} == {"cuda"}
        and q8._compile_unsupported("cuda") is None
    ):
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    if optimizer_module._global_optimizer_pre_hooks or (
        optimizer_module._global_optimizer_post_hooks
    ):
        return False
    return fused_adamw_unsupported(optimizer, mode) is None


#: One parameter of a fused step: its group, the tensor its optimizer state is kept
#: under, its weight (stepped in place), its compensation or correction (``None`` for a
#: float32 weight), its gradient and what decoupled decay keeps of it (``None``: all).
Entry = tuple[dict[str, Any], torch.Tensor, torch.Tensor, Any, torch.Tensor, Any]


def fused_adamw_step(
    mode: str,
    optimizer: torch.optim.Optimizer,
    entries: list[Entry],
    found_inf: torch.Tensor | None,
    skip: bool,
    hypers: HyperVectors,
) -> tuple[bool, torch.Tensor | None]:
    """Step ``entries`` (the parameters with gradients) with :func:`lean_adamw_fused_`,
    one call per device and ``maximize``, ``optimizer.state`` holding torch AdamW's
    state (created on a first step as torch's fused AdamW creates it: float32 moments
    for ``"split8"``'s masters, the weight's dtype for ``"kahan"``), or for
    ``"split8-8bit"`` :class:`~mixprec.optim.AdamW8bit`'s (its codes and block scales;
    one seed a step per device drawn from its checkpointed generator).

    ``found_inf`` ``None`` (with ``skip``) leaves the finite check to the step: inside
    its one call when there is one (no pass over the gradients apart from it), else
    before the calls (:func:`~mixprec.numerics.any_nonfinite`), as the calls must agree.
    A first step checks before it too, as it must know whether to create state, and
    its call still checks (the same verdict): one compiled graph for every step.
    Returns (whether the host saw a skip, the verdict the step went by): the host sees
    one only on a first step that would create state, which syncs, since a skipped step
    must leave none behind (as the inner step would)."""
    calls: dict[tuple[torch.device, bool], list[Entry]] = {}
    for entry in entries:
        if entry[4].is_sparse:
            raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
        calls.setdefault((entry[2].device, bool(entry[0].get("maximize"))), []).append(entry)
    eight_bit: Any = optimizer if mode == "split8-8bit" else None  # an AdamW8bit
    if eight_bit is not None:  # a loaded state must fit (checked before anything changes)
        for _, key, weight, _, _, _ in entries:
            if optimizer.state.get(key):
                eight_bit._check_state_size(optimizer.state[key], weight.numel())
    fresh = [e for e in entries if not optimizer.state.get(e[1])]  # get: adds no entry
    in_call = found_inf is None and len(calls) == 1
    if found_inf is None and entries and (fresh or not in_call):
        found_inf = any_nonfinite([e[4] for e in entries], entries[0][2].device)
    if fresh:
        if skip and found_inf is not None and found_inf.item():
            return True, found_inf
        for _, key, weight, _, _, _ in fresh:
            if eight_bit is not None:
                optimizer.state[key] = eight_bit._fresh_state(weight.numel(), weight.device)
                continue
            dtype = torch.float32 if mode == "split8" else weight.dtype
            optimizer.state[key] = {
                "step": torch.zeros((), dtype=torch.float32, device=weight.device),
                "exp_avg": torch.zeros_like(weight, dtype=dtype),
                "exp_avg_sq": torch.zeros_like(weight, dtype=dtype),
            }
    for (device, maximize), part in calls.items():
        states = [optimizer.state[e[1]] for e in part]
        if in_call:
            inf = None  # the one call checks its gradients
        elif skip and found_inf is not None:
            inf = found_inf.to(device, torch.float32)
        else:
            inf = torch.zeros((), device=device)
        extras = [e[3] for e in part]
        if eight_bit is None:
            m_states = [s["exp_avg"] for s in states]
            v_states = [s["exp_avg_sq"] for s in states]
        else:  # (codes, scales) pairs; the corrections paired with the step's seed
            m_states = [(s["exp_avg_q"], s["exp_avg_scale"]) for s in states]
            v_states = [(s["exp_avg_sq_q"], s["exp_avg_sq_scale"]) for s in states]
            seed = eight_bit._step_seed(device)
            extras = [(q, seed) for q in extras]
        vectors: dict[int, torch.Tensor] = {}
        for group, *_ in part:  # one lookup per group
            if id(group) not in vectors:
                vectors[id(group)] = hypers(group, device)
        verdict = lean_adamw_fused_(
            mode, [e[2] for e in part], extras, [e[4] for e in part], m_states, v_states,
            [s["step"] for s in states], [e[5] for e in part],
            [vectors[id(e[0])] for e in part], inf, maximize,
        )  # fmt: skip
        if in_call:
            found_inf = verdict
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        marked: Any = optimizer  # what an LR scheduler's wrapper of step() records
        marked._opt_called = True
    return False, found_inf


class HyperVectors:
    """Each param group's :data:`HYPER_NAMES` as a float64 vector on each device, kept
    between steps and refilled where a value changed (a filled number is a kernel
    argument; a copy from the host could wait for the GPU).

    >>> vectors = HyperVectors()
    >>> group = {"lr": 0.5, "betas": (0.9, 0.99), "eps": 1e-8}
    >>> vectors(group, torch.device("cpu")).tolist()
    [0.5, 0.9, 0.99, 1e-08]
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device],
                          tuple[tuple[float | None, ...], torch.Tensor]] = {}  # fmt: skip

    def __call__(self, group: dict[str, Any], device: torch.device) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        values = (group["lr"], beta1, beta2, group["eps"])
        numbers = tuple(None if isinstance(v, torch.Tensor) else float(v) for v in values)
        key = (id(group), device)
        old, vector = self._cache.get(key) or (
            (None,) * len(HYPER_NAMES),
            torch.empty(len(HYPER_NAMES), dtype=torch.float64, device=device),
        )
        for i, (number, value) in enumerate(zip(numbers, values)):
            if number is None:  # a tensor hyperparameter: copied on the device every step
                vector[i].copy_(value)
            elif number != old[i]:
                vector[i].fill_(number)
        self._cache[key] = (numbers, vector)
        return vector


def fused_adamw_unsupported(optimizer: torch.optim.Optimizer, mode: str) -> str | None:
    """Why :func:`lean_adamw_fused_` cannot take ``optimizer``'s step in ``mode``, or
    ``None``: it must be ``torch.optim.AdamW`` (or ``Adam`` with decoupled weight decay)
    without ``amsgrad`` or ``differentiable``, with numbers or tensors for its
    hyperparameters; or, for ``"split8-8bit"``, :class:`~mixprec.optim.AdamW8bit`."""
    eight_bit = type(optimizer) is q8.AdamW8bit
    if mode == "split8-8bit" or eight_bit:
        if eight_bit and mode == "split8-8bit":
            return None
        return (f"{type(optimizer).__name__} with master_weights={mode.split('-')[0]!r}: "
                "AdamW8bit steps fused only under master_weights='split8'")  # fmt: skip
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return f"{type(optimizer).__name__} is not torch.optim.AdamW"
    for group in optimizer.param_groups:
        if type(optimizer) is torch.optim.Adam and group.get("weight_decay") and not group.get(
            "decoupled_weight_decay"
        ):
            return "Adam's coupled weight_decay reads the weight inside the step"
        for flag in ("amsgrad", "differentiable"):
            if group.get(flag):
                return f"{flag}=True is not fused"
        if not all(isinstance(b, (float, int, torch.Tensor)) for b in group["betas"]):
            return "betas must be numbers or tensors"
    return None
