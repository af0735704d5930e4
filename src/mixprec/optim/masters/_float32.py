"""``master_weights="fp32"``: float32 copies of the low-precision parameters, stepped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mixprec._checks import LOW_PRECISION
from mixprec.kernels.adamw import FLOAT32_MASTERS
from mixprec.loss_scale import step_or_skip
from mixprec.numerics import dtensor_type, is_dtensor, is_flat_shard, local_shards
from mixprec.optim._clipping import decay_
from mixprec.optim.masters._fused import (
    HyperVectors,
    fused_adamw_step,
    kept_fractions,
    wants_fused,
)

if TYPE_CHECKING:
    from mixprec.typing import MasterWeightsMode


def _written(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """What changes when each of ``params`` is written: its version (in-place writes) and,
    for a plain tensor, where its data starts (``p.data = ...`` keeps the version but
    moves that). Runs on every parameter twice a step: the DTensor type is looked up once."""
    dtensor = dtensor_type()
    if dtensor is None:
        return [(p._version, p.data_ptr()) for p in params]
    return [(p._version, 0 if isinstance(p, dtensor) else p.data_ptr()) for p in params]




class MasterWeights:
    """Float32 masters of ``optimizer``'s low-precision parameters (swapped in, in place).

    With float16/bfloat16 parameters an update smaller than half a unit in the last
    place (``|update| / |weight| < 2**-11`` for float16) rounds away and the model
    stalls. Master weights keep a float32 copy of every low-precision parameter; the
    inner optimizer steps the copies, and the result is copied back into the model::

        model param (fp16) --grad--> master.grad (fp32) --unscale, clip--> inner.step(masters)
                                                                              |
        model param (fp16) <------------------ copy back -------------------- master (fp32)

    Parameters that are already float32 (normalisation layers kept in float32) serve
    as their own masters. The inner optimizer's ``param_groups`` hold the masters, so
    its state (and ``state_dict``) is float32 too. Sharded parameters (FSDP2 DTensors,
    FSDP1 flat parameters) get masters sharded alike, and copies go shard to shard.

    With ``torch.optim.AdamW(fused=True)`` on a GPU (:attr:`fused`), a step that needs no
    float32 master gradient is :meth:`fused_step` instead: one compiled loop per
    parameter reads the model's gradient and writes the rounded weight, so neither the
    gradient copy nor the copy back exists (28 bytes per bfloat16 parameter moved, and
    the step's peak is the bfloat16 gradients on top of the masters and moments).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    >>> opt = torch.optim.SGD([w], lr=1e-4)
    >>> mw = MasterWeights(opt)
    >>> opt.param_groups[0]["params"][0].dtype
    torch.float32
    """

    @staticmethod
    def check(optimizer: torch.optim.Optimizer) -> None:
        """Raise ``ValueError`` unless ``optimizer`` holds a low-precision parameter."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(p.dtype in LOW_PRECISION for p in params):
            dtypes = sorted({str(p.dtype) for p in params})
            raise ValueError(
                f"master_weights=True needs float16 or bfloat16 parameters, but every parameter "
                f"is {', '.join(dtypes)}; cast the model first (e.g. amp.initialize(level='O2')) "
                "or leave master_weights=False"
            )

    #: The mode's name in the registry and in checkpoints.
    mode: ClassVar[MasterWeightsMode] = "fp32"
    #: What ``LossScaleOptimizer.master_weights`` reports (the protocol's ``option``).
    option: bool | str = True
    stateful = True

    #: The fused step (:meth:`fused_step`; docs/guides/master-weights.md, "The fused
    #: step"): ``None`` (the default) with ``torch.optim.AdamW(fused=True)`` on a GPU,
    #: ``True`` wherever ``torch.compile`` runs, ``False`` never.
    #: ``LossScaleOptimizer`` takes it on steps that need no float32 master gradients
    #: in memory: no ``unscale_()`` call, clipping option, gradient accumulation or loss
    #: scale other than 1 (bfloat16 without loss scaling).
    fused: bool | None = None

    #: What :meth:`fused_step` computes (a format of
    #: :func:`~mixprec.kernels.adamw.masters_adamw_math_`);
    #: ``None``: this mode has no fused step.
    _fused_mode: str | None = FLOAT32_MASTERS

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.check(optimizer)
        self.optimizer = optimizer
        self._hypers: Any = None  # the fused step's hyperparameter vectors, on first use
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = p.detach().clone().float() if p.dtype in LOW_PRECISION else p
                if master is not p and p in optimizer.state:
                    # State created before wrapping follows its parameter to the master.
                    optimizer.state[master] = {
                        k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                        for k, v in optimizer.state.pop(p).items()
                    }
                self.model_params.append(p)
                self.masters.append(master)
                masters.append(master)
            group["params"] = masters
        self._low = [(p, m) for p, m in zip(self.model_params, self.masters) if p is not m]
        # Whether a master is sharded (a DTensor or an FSDP1 flat shard): copies then go
        # shard to shard. Known at wrapping: sharding comes before the optimizer.
        self._sharded = any(is_dtensor(p) or is_flat_shard(p) for p, _ in self._low)
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
        self._versions: list[tuple[int, int]] = []  # the low parameters as we wrote them
        # Shown by unscale_(): (param, master, its own data, its own grad) ...
        self._shown: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]] = []
        # ... and sharded ones: (param, master, the gradient written, its version).
        self._written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        # Per group: the masters' gradients as views of one float32 buffer, kept from step
        # to step (key: the masters, shapes and devices they were made for). zero_grad
        # frees the buffer's storage and the next step grows it back under the same
        # views: one allocation a step, not one view per parameter (host time).
        self._grad_views: dict[int, tuple[tuple, torch.Tensor, list[torch.Tensor]]] = {}
        self._mark_model_current()

    def add_param_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Replace a new group's low-precision params by masters; return the new group."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        masters = []
        for p in params:
            master = p.detach().clone().float() if p.dtype in LOW_PRECISION else p
            self.model_params.append(p)
            self.masters.append(master)
            if master is not p:
                self._low.append((p, master))
                self._groups = None
            masters.append(master)
        self._sharded = any(is_dtensor(p) or is_flat_shard(p) for p, _ in self._low)
        self._mark_model_current()
        return {**group, "params": masters}

    # -- the model is the truth ----------------------------------------------------------
    # Users read and write the model's parameters, not the masters: they load weights
    # into it, edit it in place, clip its gradients and log them from hooks. Two
    # mechanisms keep the masters faithful to that without copying anything on a
    # normal step:
    # * parameter version counters (bumped by every in-place write, load_state_dict's
    #   copy_ included): a model parameter written since the masters were copied into it
    #   hands its new values to its master before the next step;
    # * between unscale_() and the step, each model parameter shows its master
    #   (``p.data`` and ``p.grad`` become the float32 master's), so torch's clipping
    #   recipe, hooks and loggers see and edit exactly the unscaled gradients that are
    #   stepped. The step (or zero_grad) gives the parameters their storage back.

    def _mark_model_current(self) -> None:
        self._versions = _written([p for p, _ in self._low])

    def adopt_model_edits(self) -> None:
        """Masters of model parameters written since the last copy (in place, or given new
        storage: ``p.data = ...``, ``Module.to``) take the new values.

        Elements whose low-precision value still equals the rounded master keep the
        master's extra bits, so re-loading the model's own checkpoint changes nothing.
        """
        now = _written([p for p, _ in self._low])
        changed = [(p, m) for (p, m), w, v in zip(self._low, now, self._versions) if w != v]
        if not changed:
            return
        with torch.no_grad():
            for p, m in changed:
                if m.device != p.device:  # the model moved (accelerate's prepare, Module.to)
                    m.data = m.data.to(p.device)  # the same master object, on p's device
                for weight, master in zip(local_shards([p]), local_shards([m])):
                    master.copy_(torch.where(weight == master.to(weight.dtype), master, weight))
        self._mark_model_current()

    def show_masters_in_model(self) -> None:
        """Until :meth:`restore_model`: each model parameter shows its float32 master and
        the master's (unscaled) gradient, so edits of ``p.grad`` are edits of the step's.

        Sharded parameters (DTensors, FSDP1 flat shards) cannot change dtype: they get
        the unscaled gradients written into their own ``.grad``; edits made there are
        taken back (at their precision) by :meth:`restore_model`.
        """
        with torch.no_grad():
            for p, m in self._low:
                grad = p.grad
                if is_dtensor(p) or is_flat_shard(p):
                    if grad is not None and m.grad is not None:
                        torch._foreach_copy_(local_shards([grad]), local_shards([m.grad]))
                        self._written.append((p, m, grad, grad._version))
                    continue
                self._shown.append((p, m, p.data, grad))
                p.grad = None
                p.data = m.data
                p.grad = m.grad

    def restore_model(self) -> None:
        """Give the model parameters shown by :meth:`show_masters_in_model` their own
        storage back; their ``.grad`` holds the unscaled (possibly edited) gradient, and
        the masters step with the edited gradients."""
        shown, self._shown = self._shown, []
        written, self._written = self._written, []
        if not shown and not written:  # nothing shown since the last step: nothing to give back
            return
        with torch.no_grad():
            for p, m, grad, version in written:  # sharded: take edits of the gradient back
                if p.grad is not grad or grad._version != version:
                    m.grad = None if p.grad is None else p.grad.to(torch.float32)
            for p, m, data, grad in shown:
                m.grad = p.grad  # the user may have dropped or replaced it
                p.grad = None
                p.data = data
                if grad is not None and m.grad is not None and grad.shape == m.grad.shape:
                    grad.copy_(m.grad)
                    p.grad = grad
                elif m.grad is not None:
                    p.grad = m.grad.to(data.dtype)
        self._mark_model_current()

    def _grouped(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(model params, masters) lists per (device, dtype), for fused copies."""
        if self._groups is None:
            groups: dict[tuple, tuple[list, list]] = {}
            for p, m in self._low:
                models, masters = groups.setdefault((p.device, p.dtype), ([], []))
                models.append(p)
                masters.append(m)
            self._groups = list(groups.values())
        return self._groups

    def grads_to_masters(self) -> None:
        """Copy each low-precision gradient into its master's float32 gradient (fused).

        Masters whose gradient was dropped (``zero_grad(set_to_none=True)``) get views
        of one float32 buffer per group, kept from step to step: zero_grad frees its
        storage and this grows it back under the same views (one allocation and one
        fused copy a step, not one cast kernel per parameter; DTensors, sharded, get
        their own casts). Model parameters written since the last step first hand
        their values to their masters (:meth:`adopt_model_edits`). Written out in one
        body, as it runs at every step.
        """
        if _written([p for p, _ in self._low]) != self._versions:
            self.adopt_model_edits()
        dtensor = dtensor_type() if self._sharded else None  # looked up once a step
        groups = self._groups if self._groups is not None else self._grouped()
        with torch.no_grad():
            for index, (models, masters) in enumerate(groups):
                src, dst, missing = [], [], []
                for p, m in zip(models, masters):
                    grad, master_grad = p.grad, m.grad
                    if grad is None:
                        m.grad = None
                    elif master_grad is not None and master_grad.shape == grad.shape:
                        src.append(grad)
                        dst.append(master_grad)
                    elif dtensor is not None and isinstance(grad, dtensor):
                        m.grad = grad.float()
                    else:
                        missing.append((grad, m))
                if missing:
                    key = tuple((id(m), m.shape, m.device) for _, m in missing)
                    cached = self._grad_views.get(index)
                    if cached is not None and cached[0] == key:  # last step's views
                        flat, views = cached[1], cached[2]
                        storage = flat.untyped_storage()
                        if storage.nbytes() == 0:  # freed by zero_grad: grown back
                            storage.resize_(flat.numel() * flat.element_size())
                    else:
                        sizes = [m.numel() for _, m in missing]
                        flat = torch.empty(sum(sizes), dtype=torch.float32, device=masters[0].device)
                        views = [v.view_as(m) for v, (_, m) in zip(flat.split(sizes), missing)]
                        if self.reuses_gradient_views:
                            self._grad_views[index] = (key, flat, views)
                    for (grad, m), view in zip(missing, views):
                        m.grad = view
                        src.append(grad)
                        dst.append(view)
                if dst and dtensor is None:
                    torch._foreach_copy_(dst, src)
                elif dst:
                    torch._foreach_copy_(local_shards(dst), local_shards(src))

    def gradients_to_check(self) -> list[torch.Tensor | None]:
        """After :meth:`grads_to_masters`, the tensors whose infs and NaNs are this step's:
        the model's gradients, which the masters' copy exactly in half the bytes; on a
        CPU (:func:`~mixprec.numerics.cpu_shortcuts`), the masters' gradient buffers where
        every view of one is a master's gradient now (one norm over a buffer the copy
        left in cache, not a norm per parameter, first to touch the gradients after the
        backward), the other masters' gradients, and the float32 parameters' own. A GPU
        reads the bfloat16 gradients, half the bytes.

        >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        >>> masters = MasterWeights(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.bfloat16)
        >>> masters.grads_to_masters()
        >>> [t.shape for t in masters.gradients_to_check()]  # one buffer, not per parameter
        [torch.Size([3])]
        """
        if not (_get_current_dispatch_mode() is None  # cpu_shortcuts, written out
                and all(p.device.type == "cpu" for p in self.model_params)):
            return [p.grad for p in self.model_params]
        current = {id(m.grad) for _, m in self._low if m.grad is not None}
        tensors: list[torch.Tensor | None] = []
        covered: set[int] = set()
        for _, flat, views in self._grad_views.values():
            if flat.untyped_storage().nbytes() and all(id(v) in current for v in views):
                tensors.append(flat)
                covered.update(map(id, views))
        if not covered:  # (split modes make their buffers anew each step)
            return [p.grad for p in self.model_params]
        tensors += [m.grad for _, m in self._low if id(m.grad) not in covered]
        low = {id(p) for p, _ in self._low}
        return tensors + [p.grad for p in self.model_params if id(p) not in low]

    #: Whether master gradients keep their views between steps (see ``_grad_views``).
    reuses_gradient_views = True

    def masters_to_model(self) -> None:
        """Copy the masters back into the model's low-precision parameters (fused)."""
        if self._shown or self._written:
            self.restore_model()
        with torch.no_grad():
            for models, masters in self._groups if self._groups is not None else self._grouped():
                if not self._sharded:
                    torch._foreach_copy_(models, masters)
                else:
                    torch._foreach_copy_(local_shards(models), local_shards(masters))
        self._versions = _written([p for p, _ in self._low])  # _mark_model_current

    def step(
        self,
        found_inf: torch.Tensor | None,
        *,
        skip: bool,
        weight_decay: float | None = None,
        applied: torch.Tensor | None = None,
        step_kwargs: dict[str, Any] | None = None,
        fused: bool = False,
    ) -> tuple[bool, torch.Tensor | None]:
        """Step the masters: the :meth:`fused_step` if ``fused``, else decoupled decay
        (``weight_decay``, by ``applied``) and the inner optimizer's step unless ``skip``
        and ``found_inf``; the caller then copies them back (:meth:`masters_to_model`).
        Returns (whether the host saw a skip, the verdict the step went by)."""
        if fused:
            return self.fused_step(found_inf, skip, weight_decay)
        assert found_inf is not None  # only a fused step checks the gradients itself
        if weight_decay and applied is not None:
            with torch.no_grad():
                decay_(self.optimizer.param_groups, weight_decay, applied)
        _, skipped = step_or_skip(self.optimizer, found_inf, skip=skip, kwargs=step_kwargs)
        return skipped, found_inf

    # -- the fused step ---------------------------------------------------------------

    def fuses(self) -> bool:
        """Whether the next step can be the fused one (:attr:`fused`): this mode has
        one, its parameters are plain tensors (sharded masters copy shard to shard)
        and none shows its master (``unscale_()`` was not called)."""
        if self._fused_mode is None or self._shown or self._written or self.fused is False:
            return False
        if self.fused is None and self.model_params and self.model_params[0].device.type != "cuda":
            return False  # the default fuses on GPUs only: wants_fused's first test, early
        return wants_fused(self.optimizer, self.fused, self._fused_mode) and self._fusable()

    def _fusable(self) -> bool:
        return not self._sharded

    def fused_step(
        self, found_inf: torch.Tensor | None, skip: bool, weight_decay: float | None
    ) -> tuple[bool, torch.Tensor | None]:
        """Step the masters with one compiled function per device from the model's own
        gradients (decoupled decay, the inner optimizer's and ``weight_decay``, folded
        in) and write the rounded weights into the model: no float32 master gradient
        and no copy back. ``found_inf`` ``None`` has the step check the gradients
        itself (``skip`` must be true). Returns (whether the host saw a skip, the
        verdict the step went by: ``found_inf`` or its own, ``None`` if no parameter
        had a gradient)."""
        if self._hypers is None:
            self._hypers = HyperVectors()
        device = self.model_params[0].device if self.model_params else None
        kept = kept_fractions(self.optimizer, found_inf, skip, weight_decay, device)
        with torch.no_grad():
            skipped, verdict = fused_adamw_step(
                self._fused_mode or "", self.optimizer, self._fused_entries(kept), found_inf,
                skip, self._hypers,
            )  # fmt: skip
        self._mark_model_current()
        return skipped, verdict

    def _fused_entries(self, kept: dict[int, torch.Tensor]) -> list[Any]:
        """:func:`~mixprec.optim.masters._fused.fused_adamw_step`'s entries: per parameter
        with a gradient, (group, master, master, the model's weight or ``None`` for a
        float32 parameter, the model's gradient, what decay keeps)."""
        self.adopt_model_edits()
        models = {id(m): p for p, m in self._low}
        entries = []
        for group in self.optimizer.param_groups:
            for m in group["params"]:
                p = models.get(id(m), m)
                if p.grad is not None:
                    weight = None if p is m else p.data
                    entries.append((group, m, m.data, weight, p.grad, kept.get(id(m))))
        return entries

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients (the masters' are overwritten each step);
        with ``set_to_none``, also the masters' gradients that are kept views, whose
        buffer's storage is freed (the next step grows it back)."""
        if self._shown or self._written:
            self.restore_model()
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()
        if set_to_none:
            for _, flat, views in self._grad_views.values():
                kept = set(map(id, views))
                for m in self.masters:
                    if id(m.grad) in kept:
                        m.grad = None
                flat.untyped_storage().resize_(0)

    def state_dict(self) -> dict[str, Any]:
        self.adopt_model_edits()
        return {"masters": [m.detach().clone() for _, m in self._low]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "masters" not in state:  # a lean mode's entry (LeanUpdates)
            raise ValueError(
                f"the checkpoint's master weights are {state.get('mode')!r}, this optimizer's "
                f"are 'fp32'; build the optimizer with master_weights={state.get('mode')!r}"
            )
        saved = state["masters"]
        if len(saved) != len(self._low) or any(
            s.shape != m.shape for s, (_, m) in zip(saved, self._low)
        ):
            raise ValueError("master-weight state does not match the optimizer's parameters")
        with torch.no_grad():
            for s, (_, m) in zip(saved, self._low):
                m.copy_(s)
        self.masters_to_model()
