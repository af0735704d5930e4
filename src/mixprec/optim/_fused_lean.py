"""The lean ``"kahan"`` step with AdamW as one compiled elementwise function.

The eager lean step (:class:`~mixprec.optim._lean.LeanUpdates`) runs the inner
optimizer on the compensation buffers, then rounds in float32: separate kernels around
a float32 sum held in memory, about 38 bytes moved per bfloat16 parameter with AdamW.
:func:`kahan_adamw_` is that step written as one pure elementwise function of each
parameter's tensors: AdamW's update (torch's arithmetic, the moments in the
parameter's dtype), decoupled decay folded into the float32 sum, the Kahan split, and
the skip on ``found_inf``. Compiled (:func:`kahan_adamw_fused_`), each parameter's
weight, compensation, gradient and moments are read once and written once: 18 bytes
per bfloat16 parameter (10 read, 8 written).

The function is its own eager reference, and it differs from the eager lean step in
one rounding: the eager step rounds ``c - update`` to bfloat16 (the inner optimizer
writes its update into the bfloat16 buffer) before adding the decayed weight; here
``weight * kept + c - update`` is formed in float32 and rounded once, so the split
keeps a little more of each update. Compiled and eager runs of this function agree up
to the rounding of reordered float32 operations (inductor may fuse a multiply and an
add into one FMA), and the skip and the step counts are exact either way. Checkpoints
are the inner ``AdamW``'s, so a run can move between the fused and the eager lean step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["kahan_adamw_", "kahan_adamw_fused_", "fused_kahan_unsupported", "HYPER_NAMES",
           "COMBO_NODES"]  # fmt: skip

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
    kept: list[torch.Tensor],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor,
    maximize: bool = False,
) -> None:
    """One AdamW step with Kahan-compensated low-precision weights, in place.

    For each parameter ``i``: ``weights[i]`` (bfloat16 or float16, or float32 for a
    parameter kept in float32, whose ``compensations[i]`` is ``None``), its gradient,
    torch AdamW's state (``exp_avg``, ``exp_avg_sq`` in the weight's dtype, the
    float32 0-dim ``step``), ``kept[i]`` what decoupled decay keeps (``1 - lr * decay``,
    a 1-element float32 tensor) and ``hypers[i]`` its group's float64 vector of
    :data:`HYPER_NAMES`. A nonzero ``found_inf`` (float32, 0-dim) leaves everything as
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
    one number: a loop of its own would be one more launch per parameter).
    """
    _kahan_adamw_math_(weights, compensations, grads, exp_avgs, exp_avg_sqs, steps, kept,
                       hypers, found_inf, maximize)  # fmt: skip
    torch._foreach_add_(steps, 1.0 - found_inf)


def _kahan_adamw_math_(
    weights: list[torch.Tensor],
    compensations: list[torch.Tensor | None],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    kept: list[torch.Tensor],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor,
    maximize: bool = False,
) -> None:
    """:func:`kahan_adamw_` without advancing ``steps`` (it reads them): the part that
    compiles into per-parameter loops."""
    applied = 1.0 - found_inf
    skip = found_inf != 0
    for i, (w, g, m, v, step) in enumerate(zip(weights, grads, exp_avgs, exp_avg_sqs, steps)):
        c = compensations[i]
        lr, beta1, beta2, eps = hypers[i].unbind()
        g32 = -g.float() if maximize else g.float()
        t = step + applied
        m32 = m.float() * beta1 + g32 * (1 - beta1)
        v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
        step_size = lr / (1 - beta1**t)
        root2 = (1 - beta2**t).sqrt()
        update = m32 / (v32.sqrt() / root2 + eps) * step_size
        total = w.float() * kept[i].reshape(()) - update  # 0-dim: a 0-dim weight stays so
        if c is not None:
            total = total + c.float()
            rounded = total.to(w.dtype)
            c.copy_(torch.where(skip, c, (total - rounded.float()).to(c.dtype)))
            w.copy_(torch.where(skip, w, rounded))
        else:
            w.copy_(torch.where(skip, w, total.to(w.dtype)))
        m.copy_(torch.where(skip, m, m32.to(m.dtype)))
        v.copy_(torch.where(skip, v, v32.to(v.dtype)))


@functools.cache
def _compiled() -> Any:
    # One graph per list layout (count, shapes, dtypes): a model's step compiles once.
    # Combo kernels put the parameters' loops side by side in a few launches on a GPU.
    # Emulated precision casts: inductor otherwise keeps float32 through a round trip
    # to bfloat16, and the compensation, total - float(round(total)), would be lost.
    options = {"combo_kernels": True, "combo_kernel_max_num_nodes": COMBO_NODES,
               "emulate_precision_casts": True}  # fmt: skip
    return torch.compile(_kahan_adamw_math_, fullgraph=True, dynamic=False, options=options)


def kahan_adamw_fused_(
    weights: list[torch.Tensor],
    compensations: list[torch.Tensor | None],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    kept: list[torch.Tensor],
    hypers: list[torch.Tensor],
    found_inf: torch.Tensor,
    maximize: bool = False,
) -> None:
    """:func:`kahan_adamw_` (same arguments) with its elementwise math through
    ``torch.compile``: one loop per parameter that reads and writes each tensor once,
    side by side in a few launches on a GPU (inductor's combo kernels). Under a
    ``TorchDispatchMode`` (a FLOP counter, a debugging mode) the eager math runs, as
    ``torch.compile`` itself would, so the mode sees the step's ops; a profiler sees
    the step as ``mixprec.kahan_adamw``."""
    args = (weights, compensations, grads, exp_avgs, exp_avg_sqs, steps, kept, hypers,
            found_inf, maximize)  # fmt: skip
    with torch.profiler.record_function("mixprec.kahan_adamw"):
        math = _kahan_adamw_math_ if _get_current_dispatch_mode() is not None else _compiled()
        math(*args)
        torch._foreach_add_(steps, 1.0 - found_inf)


def fused_kahan_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why :func:`kahan_adamw_fused_` cannot take ``optimizer``'s step, or ``None``: it
    must be ``torch.optim.AdamW`` (or ``Adam`` with decoupled weight decay) without
    ``amsgrad`` or ``differentiable``, with numbers or tensors for its hyperparameters."""
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
