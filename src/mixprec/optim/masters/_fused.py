"""The fused AdamW step of the master-weight modes: one compiled call per device.

:func:`fused_adamw_step` steps the modes' parameters with the compiled step bodies of
:mod:`mixprec.kernels` (each tensor read once and written once) instead of calling
the inner optimizer's ``step()``; its state is the inner optimizer's own, so a
checkpoint moves freely between the fused and the eager steps. :func:`wants_fused`
says when a mode takes it (docs/guides/master-weights.md, "The fused step").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as optimizer_module

from mixprec.kernels.adamw import HYPER_NAMES, LOW_BITS8, LOW_BITS8_MOMENTS8
from mixprec.kernels.compiled import compile_unsupported, lean_adamw_fused_
from mixprec.numerics import any_nonfinite
from mixprec.optim._adamw8bit import AdamW8bit


def kept_fractions(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor | None,
    skip: bool,
    weight_decay: float | None,
    device: torch.device | None = None,
) -> dict[int, torch.Tensor]:
    """What decoupled decay keeps of each weight, ``1 - lr * decay`` (1 on a skipped
    step), by ``id`` of each decayed group and of each of its parameters: a 1-element
    float32 tensor on ``found_inf``'s device, which, being 1-D, makes a low-precision
    weight times it float32 in one kernel. Two scalar kernels a group, one unskipped.
    ``found_inf`` ``None`` (a fused step that checks the gradients itself): an applied
    step's fractions on ``device``, as a skipped fused step keeps every weight whatever
    decay would keep."""
    if found_inf is None:
        found_inf, skip = torch.zeros((), device=device), False
    kept = {}
    for group in optimizer.param_groups:
        decay = (weight_decay or 0.0) + (group.get("weight_decay") or 0.0)
        if not decay:
            continue
        shrink = group["lr"] * decay
        if isinstance(shrink, torch.Tensor):
            shrink = shrink.to(found_inf.device)
        if skip:  # 1 - shrink * (1 - found_inf), no host sync
            fraction = torch.mul(found_inf, shrink).add_(1.0 - shrink)
        elif isinstance(shrink, torch.Tensor):
            fraction = 1.0 - shrink
        else:
            fraction = torch.full((), 1.0 - shrink, device=found_inf.device)
        kept[id(group)] = fraction = fraction.to(torch.float32).view(1)
        kept.update((id(p), fraction) for p in group["params"])
    return kept


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
    asked = (optimizer.fused is not False if isinstance(optimizer, AdamW8bit)
             else all(g.get("fused") for g in optimizer.param_groups))  # fmt: skip
    if fused is None and not (  # the default: cheap checks first, as this runs every step
        asked
        and {p.device.type for g in optimizer.param_groups for p in g["params"]} == {"cuda"}
        and compile_unsupported("cuda") is None
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
    for 8 low bits' masters, the weight's dtype for a compensated weight), or for
    8 low bits with 8-bit moments :class:`~mixprec.optim.AdamW8bit`'s (its codes and block scales;
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
    eight_bit: Any = optimizer if mode == LOW_BITS8_MOMENTS8 else None  # an AdamW8bit
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
            dtype = torch.float32 if mode == LOW_BITS8 else weight.dtype
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
    hyperparameters; or, for :data:`~mixprec.kernels.adamw.LOW_BITS8_MOMENTS8`,
    :class:`~mixprec.optim.AdamW8bit`."""
    eight_bit = type(optimizer) is AdamW8bit
    if mode == LOW_BITS8_MOMENTS8 or eight_bit:
        if eight_bit and mode == LOW_BITS8_MOMENTS8:
            return None
        return (f"{type(optimizer).__name__} in the {mode!r} format: "
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
