"""Gradient release: each parameter is stepped as soon as its gradient is complete.

:class:`GradientRelease` registers a post-accumulate-grad hook on every parameter;
during ``backward()`` the hook steps that parameter (through its own optimizer, and
its own master weights) and frees the gradient, so at most a few parameters' gradients
exist at any time instead of the whole model's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec._checks import check_number
from mixprec.loss_scale import step_or_skip
from mixprec.numerics import any_nonfinite
from mixprec.optim._adamw8bit import AdamW8bit
from mixprec.optim._clipping import clip_gradients_
from mixprec.optim.masters import MODES, MasterMode, MasterWeights


def _option(row: MasterMode) -> bool | str:
    return False if row.name == "none" else row.name


class GradientRelease:
    """Step every parameter during ``backward()``, as its gradient lands; free the
    gradient: optimizer steps applied per parameter inside the backward pass.

    ``optimizer_factory(params)`` builds the optimizer of one parameter (it is called
    once per parameter with a one-element list); ``master_weights`` (``False``,
    ``"fp32"``, ``"split"``, ``"split8"``) gives each low-precision parameter its
    masters, stepped in float32. The gradients never coexist: with
    ``AdamW8bit`` and ``"split8"`` a bfloat16 model holds 2 + 1 + 2 bytes per parameter
    (plus block scales) through the whole step instead of 7.

    Each step ends with :meth:`end_step` (one host sync), after ``backward()``::

        release = GradientRelease(model, lambda ps: AdamW8bit(ps, lr=1e-3), master_weights="split8")
        for inputs, targets in data:
            loss_fn(model(inputs), targets).backward()   # every parameter is stepped here
            release.end_step()                           # reports non-finite gradients

    **Non-finite gradients.** Release cannot skip a whole step: by the time one
    parameter's gradient is seen, the parameters whose gradients came earlier in the
    backward pass have been stepped. mixprec's guarantee here is per parameter: a
    parameter whose gradient holds an inf or NaN is *not* stepped (its weight, masters
    and optimizer state stay exactly as they were, decided on the device when the
    optimizer is fused, such as ``AdamW8bit`` or ``torch.optim.AdamW(fused=True)``, and
    with one host sync per parameter otherwise), the event is counted in
    :attr:`skipped_steps` (per parameter) and :meth:`end_step` warns with the skipped
    parameters' names, saying that the others were stepped. It is never silent.

    **What cannot combine**, refused with the fix:

    * gradient accumulation over micro-batches: the gradient is gone after each
      backward; a second backward before :meth:`end_step` raises ``RuntimeError``.
    * clipping by the global norm (``global_clipnorm``, ``clip_grad_norm_``): the norm
      needs every gradient before any step. Per-tensor ``clipnorm`` and ``clipvalue``
      are offered instead (``clip_grad_norm_`` after ``backward()`` would find no
      gradients: there is nothing left to clip).
    * dynamic loss scaling: it skips whole steps. bfloat16 needs no scaling; float16
      takes a fixed ``loss_scale`` (the loss is multiplied by it, the hook divides).

    >>> import torch
    >>> from mixprec.optim import AdamW8bit
    >>> model = torch.nn.Linear(4, 2).bfloat16()
    >>> release = GradientRelease(model, lambda ps: AdamW8bit(ps, lr=1e-2), master_weights="split8")
    >>> before = model.weight.detach().clone()
    >>> model(torch.ones(3, 4, dtype=torch.bfloat16)).sum().backward()
    >>> release.end_step()
    0
    >>> model.weight.grad is None, bool((model.weight != before).all())
    (True, True)
    >>> model(torch.full((1, 4), float("inf"), dtype=torch.bfloat16)).sum().backward()
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     release.end_step()  # the weight's gradient is inf, the bias's is finite
    1
    >>> "weight" in str(caught[0].message), release.skipped_steps.tolist()
    (True, [1, 0])
    """

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.Tensor],
        optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        *,
        master_weights: Any = False,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        loss_scale: float | None = None,
        global_clipnorm: Any = None,
        gradient_accumulation_steps: Any = None,
    ) -> None:
        if global_clipnorm is not None:
            raise ValueError(
                f"global_clipnorm={global_clipnorm!r} cannot combine with gradient release: the "
                "global norm needs every gradient before the first step, and release steps "
                "each parameter as its gradient lands; use clipnorm= (per tensor) or "
                "clipvalue=, or LossScaleOptimizer(global_clipnorm=...) without release"
            )
        if gradient_accumulation_steps not in (None, 1):
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps!r} cannot combine "
                "with gradient release: each backward steps the parameters and frees the "
                "gradients, so there is nothing to accumulate into; use a larger batch, or "
                "LossScaleOptimizer(gradient_accumulation_steps=...) without release"
            )
        if isinstance(loss_scale, str) or (loss_scale is not None and not isinstance(
                loss_scale, (int, float))):  # fmt: skip
            raise ValueError(
                f"loss_scale={loss_scale!r}: gradient release takes no dynamic loss scale (it "
                "skips whole steps, and release has stepped earlier parameters already); "
                "train in bfloat16 (no scaling) or pass a fixed number, e.g. loss_scale=1024.0"
            )
        check_number("loss_scale", loss_scale, minimum=0, exclusive=True, allow_none=True)
        check_number("clipnorm", clipnorm, minimum=0, exclusive=True, allow_none=True)
        check_number("clipvalue", clipvalue, minimum=0, exclusive=True, allow_none=True)
        if master_weights is True:
            master_weights = MasterWeights.mode
        released = {_option(row): row for row in MODES.values() if row.release}
        if not isinstance(master_weights, (bool, str)) or master_weights not in released:
            whole = tuple(row.name for row in MODES.values() if not row.release)
            raise ValueError(
                f"master_weights must be one of {', '.join(map(repr, released))} with gradient "
                f"release, got {master_weights!r}; the lean modes {whole} step "
                "whole optimizers: use them through LossScaleOptimizer"
            )
        if not callable(optimizer_factory):
            raise TypeError(
                "optimizer_factory must be a callable taking a list of parameters and "
                f"returning an optimizer, got {type(optimizer_factory).__name__}"
            )
        listed: list[tuple[str, torch.Tensor]]
        if isinstance(params, torch.nn.Module):
            listed = list(params.named_parameters())  # shared parameters once
        else:
            tensors = list(params)
            if not all(isinstance(p, torch.Tensor) for p in tensors):
                raise TypeError("params must be an nn.Module or an iterable of tensors")
            listed = [(f"params[{i}]", p) for i, p in enumerate(tensors)]
        named: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for name, p in listed:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        if not named:
            raise ValueError("gradient release needs at least one parameter that requires grad")
        row = released[master_weights]
        master_class = None if row.name == "none" else row
        low = [p for _, p in named if p.dtype in (torch.float16, torch.bfloat16)]
        if master_class is not None:  # every parameter is checked before anything is built
            if not low:
                raise ValueError(
                    f"master_weights={master_weights!r} needs float16 or bfloat16 parameters, "
                    "but every parameter is float32; cast the model first or leave "
                    "master_weights=False"
                )
            master_class.check(torch.optim.SGD(low, lr=0.0))  # reads the dtypes only
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizers: list[torch.optim.Optimizer] = []
        self.masters: list[Any] = []
        for name, p in named:
            opt = optimizer_factory([p])
            self._check_optimizer(name, p, opt)
            self.optimizers.append(opt)
            mastered = master_class is not None and p.dtype in (torch.float16, torch.bfloat16)
            self.masters.append(master_class.build(opt) if mastered and master_class else None)
        self.master_weights = master_weights
        self.clipnorm, self.clipvalue, self.loss_scale = clipnorm, clipvalue, loss_scale
        device = self.params[0].device
        self.skipped_steps = torch.zeros(len(self.params), dtype=torch.int64, device=device)
        self._flags = torch.zeros(len(self.params), dtype=torch.float32, device=device)
        self._stepped = [False] * len(self.params)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._hook, i))
            for i, p in enumerate(self.params)
        ]

    @staticmethod
    def _check_optimizer(name: str, p: torch.Tensor, opt: Any) -> None:
        if not isinstance(opt, torch.optim.Optimizer) or hasattr(opt, "loss_scaler"):
            raise TypeError(
                "optimizer_factory must return a plain torch.optim.Optimizer (not a "
                f"LossScaleOptimizer: release does its own unscaling), got {type(opt).__name__}"
            )
        held = [q for g in opt.param_groups for q in g["params"]]
        if len(held) != 1 or held[0] is not p:
            raise ValueError(
                f"optimizer_factory([{name}]) returned an optimizer holding {len(held)} "
                "tensors, not just that parameter; build it from the list it is given"
            )

    def _hook(self, index: int, p: torch.Tensor) -> None:
        if self._stepped[index]:
            raise RuntimeError(
                f"{self.names[index]} got a second gradient before end_step(): gradient release "
                "steps every parameter in each backward and frees its gradient, so "
                "micro-batches cannot accumulate; call release.end_step() after each "
                "backward (or accumulate with LossScaleOptimizer instead)"
            )
        self._stepped[index] = True
        opt, master = self.optimizers[index], self.masters[index]
        with torch.no_grad():
            target = p
            if master is not None:
                master.grads_to_masters()  # the float32 master (rebuilt) and its gradient
                target = master.masters[0]
            grad = target.grad
            if grad is None:  # e.g. a hook of the user's dropped it
                return
            if self.loss_scale is not None:
                grad.div_(self.loss_scale)
            found_inf = any_nonfinite([grad], grad.device)  # the wrapper's check
            clip_gradients_([grad], self.clipvalue, self.clipnorm)  # LossScaleOptimizer's rules
            step_or_skip(opt, found_inf, skip=True)
            self._flags[index] = found_inf
            if master is not None:
                master.masters_to_model()  # rounds into the weight, frees the master
                target.grad = None
            p.grad = None

    def end_step(self) -> int:
        """Close the step (one host sync): count parameters skipped for non-finite
        gradients, warn naming them, and return how many were skipped."""
        flags = self._flags.clone()
        self._flags.zero_()
        self._stepped = [False] * len(self.params)
        self.skipped_steps.add_(flags.to(torch.int64))
        skipped = torch.nonzero(flags).flatten().tolist()  # the sync
        if skipped:
            names = ", ".join(self.names[i] for i in skipped[:10])
            more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
            warnings.warn(
                f"{len(skipped)} of {len(self.params)} parameters had non-finite gradients "
                f"and were not stepped: {names}{more}. The other parameters were stepped "
                "(gradient release steps each one as its gradient lands and cannot undo "
                "them); lower the learning rate or find the source of the inf/NaN",
                RuntimeWarning,
                stacklevel=2,
            )
        return len(skipped)

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter's optimizer; setting it sets all."""
        return float(self.optimizers[0].param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        check_number("lr", value, minimum=0)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = value

    def remove(self) -> None:
        """Remove the hooks: the parameters get ordinary gradients again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def state_dict(self) -> dict[str, Any]:
        """Every parameter's optimizer and master state, and the skip counts."""
        return {
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "masters": [None if m is None else m.state_dict() for m in self.masters],
            "skipped_steps": self.skipped_steps.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output; everything is checked before anything changes."""
        from mixprec.optim._loss_scale_optimizer import _check_same_layout

        keys = {"optimizers", "masters", "skipped_steps"}
        if not isinstance(state, dict) or set(state) != keys:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"a GradientRelease state dict has keys {sorted(keys)}, got {got}")
        n = len(self.params)
        if len(state["optimizers"]) != n or len(state["masters"]) != n:
            raise ValueError(
                f"the checkpoint holds {len(state['optimizers'])} parameters' optimizers, this "
                f"GradientRelease has {n}: was it saved from another model?"
            )
        counts = state["skipped_steps"]
        if not torch.is_tensor(counts) or counts.shape != self.skipped_steps.shape:
            raise ValueError(f"skipped_steps must be a tensor of shape ({n},), got {counts!r}")
        for i, (opt, master) in enumerate(zip(self.optimizers, self.masters)):
            saved, saved_master = state["optimizers"][i], state["masters"][i]
            if not isinstance(saved, dict) or len(saved.get("param_groups", ())) != len(opt.param_groups):
                raise ValueError(f"optimizer {i} ({self.names[i]}): the saved groups do not match")
            if isinstance(opt, AdamW8bit):
                opt.check_state_dict(saved)
            if (saved_master is None) != (master is None):
                raise ValueError(
                    f"{self.names[i]}: the checkpoint was saved "
                    f"{'without' if saved_master is None else 'with'} master weights, this "
                    f"GradientRelease has master_weights={self.master_weights!r}"
                )
            if master is not None:
                fp32 = MasterWeights.mode  # float32 masters' entries name no mode
                if saved_master.get("mode", fp32) != getattr(master, "mode", fp32):
                    raise ValueError(
                        f"the checkpoint's master weights are {saved_master.get('mode', fp32)!r}, "
                        f"this GradientRelease's are {self.master_weights!r}"
                    )
                _check_same_layout(master.state_dict(), saved_master, f"masters[{i}]")
        for opt, master, saved, saved_master in zip(
            self.optimizers, self.masters, state["optimizers"], state["masters"]
        ):
            opt.load_state_dict(saved)
            if master is not None:
                master.load_state_dict(saved_master)
        self.skipped_steps.copy_(counts)
