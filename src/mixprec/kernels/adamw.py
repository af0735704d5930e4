"""AdamW's update, written once, and the step bodies built on it.

:func:`adamw_moments`, :func:`adamw_bias_corrections` and :func:`adamw_direction` are
AdamW's arithmetic (torch's): every step of mixprec that does not call an inner
optimizer's ``step()`` computes its update with them. Around them:

* :func:`masters_adamw_math_` - one AdamW step of a list of parameters whose weights
  are kept in one of the master-weight formats (float32 masters, Kahan compensation,
  stochastic rounding, an 8-bit correction), elementwise, with the skip on
  ``found_inf``; :func:`kahan_adamw_` is its Kahan format as a stand-alone function.
* :func:`split8_adamw8bit_math_` - the same for 8-bit corrections with 8-bit moments.
* :func:`update_chunk` - :class:`~mixprec.optim.AdamW8bit`'s step of a chunk.

Each body is its own eager reference and compiles as it is
(:mod:`mixprec.kernels.compiled`). Pure tensor functions: they import nothing of
mixprec above the kernels (numerics is below).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.kernels.bits import join8_bits, split8_codes
from mixprec.kernels.moments8 import (
    dequantize_first_moment,
    dequantize_second_moment,
    first_moment_codes,
    noise_from_bits,
    second_moment_codes,
)
from mixprec.kernels.rounding import hashed_bits
from mixprec.numerics import cpu_shortcuts

#: The order of a group's hyperparameters in the float64 vector the step bodies read.
HYPER_NAMES = ("lr", "beta1", "beta2", "eps")

_Hyper = float | torch.Tensor  # a number, or a 0-dim float64 tensor in the compiled step


#: The weight formats the fused AdamW math updates (the ``mode`` of
#: :func:`masters_adamw_math_` and :func:`~mixprec.kernels.compiled.compile_math`):
#: how one parameter's value is held, named for what the kernels read and write.
#: A float32 master, and the model's low-precision copy written from it.
FLOAT32_MASTERS = "float32_masters"
#: A low-precision weight and a low-precision compensation of what its rounding lost.
COMPENSATED = "compensated"
#: A bfloat16 weight rounded stochastically, with the step's seed.
STOCHASTIC_ROUNDING = "stochastic_rounding"
#: A bfloat16 weight and the 8 low bits of its float32 value (float32 moments).
LOW_BITS8 = "low_bits8"
#: :data:`LOW_BITS8` weights with :class:`~mixprec.optim.AdamW8bit`'s 8-bit moments.
LOW_BITS8_MOMENTS8 = "low_bits8_moments8"


def _plus_product(
    x: torch.Tensor, a: float | torch.Tensor, y: torch.Tensor, z: torch.Tensor | None = None
) -> torch.Tensor:
    """``x + a * y`` (``* z``): torch's ``add(alpha=a)``/``addcmul(value=a)`` for a number
    ``a``; a 0-dim tensor ``a`` (the compiled step's hyperparameters) is a factor instead,
    as torch takes only numbers there, and a number would be a constant of the compiled
    graph: one graph per learning rate."""
    if isinstance(a, torch.Tensor):
        return torch.addcmul(x, y, a if z is None else z * a)
    return x.add(y, alpha=a) if z is None else x.addcmul(y, z, value=a)


def adamw_moments(
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta1: _Hyper,
    beta2: _Hyper,
    *,
    torch_alpha: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's new moments ``m * beta1 + (1 - beta1) * g`` and ``v * beta2 + (1 - beta2)
    * g * g`` in float32 (``m``, ``v``, ``g`` float32).

    Two roundings of the one formula: a product and a sum (``torch_alpha=False``, the
    fused steps'), or torch's ``add(alpha=)``/``addcmul(value=)``, which multiply and
    add in one rounding (``torch_alpha=True``: :func:`update_chunk`'s, which then scales
    ``m`` and ``v`` in place). Not ``lerp``: compiled, it picks between two formulas per
    element by its weight, a blend that costs as much as the rest.

    >>> m, v = adamw_moments(torch.zeros(2), torch.zeros(2), torch.ones(2), 0.5, 0.75)
    >>> m.tolist(), v.tolist()
    ([0.5, 0.5], [0.25, 0.25])
    """
    if torch_alpha:
        return (_plus_product(m.mul_(beta1), 1 - beta1, g),
                _plus_product(v.mul_(beta2), 1 - beta2, g, g))  # fmt: skip
    return m * beta1 + g * (1 - beta1), v * beta2 + g * g * (1 - beta2)


def adamw_bias_corrections(
    lr: _Hyper, beta1: _Hyper, beta2: _Hyper, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's step size ``lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)`` at step ``t``
    (torch's arithmetic: float64 where the hyperparameters are).

    >>> size, root = adamw_bias_corrections(0.125, 0.5, 0.75, torch.tensor(1.0))
    >>> float(size), float(root)
    (0.25, 0.5)
    """
    return lr / (1 - beta1**t), (1 - beta2**t).sqrt()


def adamw_direction(
    m: torch.Tensor, v: torch.Tensor, eps: _Hyper, step_size: Any, root2: Any
) -> torch.Tensor:
    """AdamW's update ``step_size * m / (sqrt(v) / root2 + eps)`` (subtracted from the
    weight), from :func:`adamw_moments` and :func:`adamw_bias_corrections`.

    >>> adamw_direction(torch.tensor([0.5]), torch.tensor([0.25]), 0.0, 0.5, 1.0).tolist()
    [0.5]
    """
    return m / (v.sqrt() / root2 + eps) * step_size


def bias_corrections(
    steps: torch.Tensor,
    block_ends: torch.Tensor,
    blocks: int,
    found_inf: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new step counts of a chunk's tensors and AdamW's bias corrections per block.

    ``steps`` is the float32 step count of each tensor, ``block_ends`` (int64, one per
    tensor) the cumulative block counts (tensor ``i`` owns the blocks up to
    ``block_ends[i]``) and ``blocks`` their total; a nonzero ``found_inf`` (float32,
    0-dim) leaves the counts as they are. Returns ``(steps, step_size, correction2_sqrt)``
    with torch.optim.AdamW's ``step_size = lr / (1 - beta1**step)`` and
    ``correction2_sqrt = sqrt(1 - beta2**step)``, each ``(blocks, 1)``: computed once per
    tensor and spread over its blocks, so the elementwise step reads one number a block
    instead of taking two powers an element.

    >>> steps, size, root = bias_corrections(torch.tensor([0.0, 1.0]), torch.tensor([1, 3]),
    ...                                      3, None, lr=0.125, beta1=0.5, beta2=0.75)
    >>> steps.tolist(), size.flatten().tolist(), root.flatten().tolist()  # a block, then two
    ([1.0, 2.0], [0.25, 0.1666666716337204, 0.1666666716337204], [0.5, 0.6614378094673157, 0.6614378094673157])
    """
    steps = steps + (1.0 if found_inf is None else 1.0 - found_inf)
    tensor_of_block = torch.bucketize(
        torch.arange(blocks, device=steps.device), block_ends, right=True)  # fmt: skip
    step_size, correction2_sqrt = adamw_bias_corrections(lr, beta1, beta2, steps)
    return (steps, step_size[tensor_of_block].unsqueeze(1),
            correction2_sqrt[tensor_of_block].unsqueeze(1))  # fmt: skip


def update_chunk(
    grads: torch.Tensor,
    weights: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    step_size: torch.Tensor,
    correction2_sqrt: torch.Tensor,
    noise_bits: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    *,
    lr: _Hyper,
    beta1: _Hyper,
    beta2: _Hyper,
    eps: _Hyper,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW8bit step of a chunk, as a pure function: its elementwise math, nothing else.

    ``grads`` and ``weights`` are float32 ``(blocks, block_size)`` (each tensor zero-padded
    to whole blocks), the codes and scales the chunk's stored moments, ``step_size`` and
    ``correction2_sqrt`` the bias corrections per block (:func:`bias_corrections`).
    ``noise_bits`` (non-negative int32 shaped like ``grads``, :func:`noise_from_bits`)
    rounds the new codes stochastically, ``None`` to nearest. ``grad_scale`` divides the
    gradients; a nonzero ``found_inf`` (float32, 0-dim) returns the inputs' values
    unchanged. ``lr``, ``beta1``, ``beta2`` and ``eps`` are numbers or 0-dim float64
    tensors (as the compiled step passes them); ``decay`` is a number. Returns the new
    ``(weights, m_codes, m_scales, v_codes, v_scales)``; the inputs are not modified.

    The update is ``torch.optim.AdamW``'s arithmetic on the decoded moments:
    ``w = w * (1 - lr * decay) - step_size * m / (sqrt(v) / correction2_sqrt + eps)``.

    :class:`AdamW8bit` calls it as it is (the reference) or through ``torch.compile``
    (:func:`update_chunk_fused`).
    """
    if grad_scale is not None:
        grads = grads / grad_scale
    m = dequantize_first_moment(m_codes, m_scales)
    v = dequantize_second_moment(v_codes, v_scales)
    m, v = adamw_moments(m, v, grads, beta1, beta2, torch_alpha=True)
    delta = adamw_direction(m, v, eps, step_size, correction2_sqrt)
    noise_m = noise_v = None
    if noise_bits is not None:
        noise_m, noise_v = noise_from_bits(noise_bits)
    m_codes_new, m_scales_new = first_moment_codes(m, noise_m)
    v_codes_new, v_scales_new = second_moment_codes(v, noise_v)
    applied = None if found_inf is None else 1.0 - found_inf
    # A skipped step keeps everything. Compiled, the codes are picked while still
    # float32 (a blend of int8 codes compiles to ten times the cost of one of floats)
    # and the condition is expanded to the elements' shape (a blend by a 0-dim
    # condition costs more than one by a tensor of them); eager, the int8 codes are
    # picked (a quarter of the bytes). Codes are whole numbers: the same either way.
    compiled = torch.compiler.is_compiling()
    if applied is not None:
        skip = (applied == 0).expand_as(m) if compiled else applied == 0
        delta = torch.where(skip, 0.0, delta)
        scale_skip = skip[:, 0] if compiled else skip
        m_scales_new = torch.where(scale_skip, m_scales, m_scales_new)
        v_scales_new = torch.where(scale_skip, v_scales, v_scales_new)
        if compiled:
            m_codes_new = torch.where(skip, m_codes.float(), m_codes_new)
            v_codes_new = torch.where(skip, v_codes.float(), v_codes_new)
    m_codes_new, v_codes_new = m_codes_new.to(torch.int8), v_codes_new.to(torch.uint8)
    if applied is not None and not compiled:
        m_codes_new = torch.where(skip, m_codes, m_codes_new)
        v_codes_new = torch.where(skip, v_codes, v_codes_new)
    if decay:
        weights = weights * (1 - lr * decay * (1.0 if applied is None else applied))
    return weights - delta, m_codes_new, m_scales_new, v_codes_new, v_scales_new


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
    in it (:func:`_steps_in_loop`).
    """
    masters_adamw_math_(COMPENSATED, weights, compensations, grads, exp_avgs, exp_avg_sqs, steps,
                      kept, hypers, found_inf, maximize, _steps_in_loop(weights, COMPENSATED))  # fmt: skip
    _advance_apart(weights, steps, found_inf, COMPENSATED)


def masters_adamw_math_(
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
    steps_in_loop: bool = False,
) -> list[torch.Tensor]:
    """:func:`kahan_adamw_` (``mode=COMPENSATED``, ``extras`` the compensations) or
    :data:`LOW_BITS8` (``extras`` the int8 corrections of :func:`~mixprec.kernels.bits.split8_bits`,
    the moments float32: ``master = join8(w, q) * kept - update; w = round(master);
    q = split8(master, w)``), advancing ``steps`` only if
    ``steps_in_loop`` (:func:`_steps_in_loop`; else it reads them, and they advance
    apart): the part that compiles into one loop per parameter.

    :data:`STOCHASTIC_ROUNDING` rounds ``w * kept - update`` stochastically into the bfloat16
    weight (as :func:`~mixprec.kernels.rounding.stochastic_round`, with the noise of
    :func:`hashed_bits`); ``extras`` hold the step's int64 seed (``None`` for a float32
    parameter).

    :data:`FLOAT32_MASTERS` is float32 masters' step (``master_weights="fp32"``): ``weights``
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
    corrections: list[torch.Tensor] = []
    for i, (w, g, m, v, step) in enumerate(zip(weights, grads, exp_avgs, exp_avg_sqs, steps)):
        extra = extras[i]
        lr, beta1, beta2, eps = hypers[i].unbind()
        g32 = -g.float() if maximize else g.float()
        m32, v32 = adamw_moments(m.float(), v.float(), g32, beta1, beta2)
        t = step + applied
        step_size, root2 = adamw_bias_corrections(lr, beta1, beta2, t)
        corrections += [step_size, root2]
        update = adamw_direction(m32, v32, eps, step_size, root2)
        split8 = mode == LOW_BITS8 and extra is not None
        start = join8_bits(w, extra) if split8 else w.float()
        keep = kept[i]  # None: no decay, and no multiply by one in the loop
        if keep is not None:
            start = start * keep.reshape(())  # 0-dim: a 0-dim weight stays so
        total = start - update
        if mode == FLOAT32_MASTERS and extra is not None:
            total = torch.where(skip, w, total)
            w.copy_(total)
            extra.copy_(total.to(extra.dtype))
        elif mode == STOCHASTIC_ROUNDING and extra is not None:
            bits = total.view(torch.int32) + hashed_bits(extra, i, w.shape, w.device)
            rounded = bits.bitwise_and(-65536).view(torch.float32).to(w.dtype)  # 0xFFFF0000
            w.copy_(torch.where(skip, w, rounded))
        elif split8:
            rounded = total.to(w.dtype)
            extra.copy_(torch.where(skip, extra.float(), split8_codes(total, rounded)))
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
        if steps_in_loop:
            step.copy_(t)
    return [found_inf, *_kept_on_cpu(weights, corrections)]


def split8_adamw8bit_math_(
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
    steps_in_loop: bool = False,
) -> list[torch.Tensor]:
    """:data:`LOW_BITS8_MOMENTS8`: :data:`LOW_BITS8` masters stepped by
    :class:`~mixprec.optim.AdamW8bit`, in place, neither the float32 masters nor the
    float32 moments materialised: :func:`masters_adamw_math_`'s arguments, with
    ``extras[i]`` the pair (int8 correction or ``None`` for a float32 parameter, the
    step's int64 seed or ``None`` for round-to-nearest codes) and ``exp_avgs[i]``,
    ``exp_avg_sqs[i]`` each the pair (codes, float32 block scales) of AdamW8bit's state.
    Per parameter, in float32 (the gradient zero-padded to whole blocks, as AdamW8bit
    pads it)::

        m = decode(m_codes) * beta1 + (1 - beta1) * g    # and v: AdamW8bit's format
        master = join8(w, q) * kept - AdamW's update(m, v)
        w = round(master);  q = split8(master, w);  codes, scales = encode(m), encode(v)

    The codes are rounded stochastically with the 31 bits of :func:`hashed_bits` per
    element (:func:`~mixprec.kernels.moments8.noise_from_bits` splits them between
    the two moments), where the eager ``AdamW8bit`` step draws them from its generator;
    the rest is its arithmetic (:func:`update_chunk`).
    Codes are picked while still float32 on a skipped step (whole numbers, the same
    either way; a blend of int8 codes compiles to ten times the cost). ``found_inf``
    ``None`` and the result as :func:`masters_adamw_math_`'s; the step counts always
    advance apart (``steps_in_loop`` is ignored)."""
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
        m32, v32 = adamw_moments(dequantize_first_moment(m_codes, ms),
                                 dequantize_second_moment(v_codes, vs), g32, beta1, beta2)  # fmt: skip
        t = step + applied
        step_size, root2 = adamw_bias_corrections(lr, beta1, beta2, t)
        corrections += [step_size, root2]
        update = adamw_direction(m32, v32, eps, step_size, root2)
        noise_m = noise_v = None
        if seed is not None:
            noise_m, noise_v = noise_from_bits(
                hashed_bits(seed, i, m32.shape, m32.device, bits=31))  # fmt: skip
        new_m_codes, new_m_scales = first_moment_codes(m32, noise_m)
        new_v_codes, new_v_scales = second_moment_codes(v32, noise_v)
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
            correction.copy_(torch.where(skip, correction.float(), split8_codes(total, rounded)))
        w.copy_(torch.where(skip, w, rounded))
        m_codes.copy_(torch.where(skip, m_codes.float(), new_m_codes))
        v_codes.copy_(torch.where(skip, v_codes.float(), new_v_codes))
        ms.copy_(torch.where(skip, ms, new_m_scales))
        vs.copy_(torch.where(skip, vs, new_v_scales))
    return [found_inf, *_kept_on_cpu(weights, corrections)]

def _steps_in_loop(weights: list[torch.Tensor], mode: str) -> bool:
    """Whether ``mode``'s step function advances the step counts of ``weights`` (one
    device) itself: on a CPU, in the compiled loop (one number stored). Apart from it,
    ``torch._foreach_add_`` with a tensor operand takes its per-tensor path on a CPU, a
    cast and an add per count: about 60 us a step for a 31-tensor model, a twentieth of
    its compiled step. Not the split8 + ``AdamW8bit`` step: there one more written input
    made inductor write the codes and corrections into buffers and copy them out (12
    loops for two parameters instead of 7). On a GPU a count advanced in the graph
    would be a kernel of its own, so one foreach launch after the call advances them
    all."""
    return mode != LOW_BITS8_MOMENTS8 and bool(weights) and cpu_shortcuts(weights[0].device)


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
