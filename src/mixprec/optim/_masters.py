"""What the optimizer steps: the master-weight modes behind one small interface.

Low-precision parameters lose every update smaller than half a unit in the last
place, so mixprec steps something else and writes the result into the model. A mode
is chosen with ``master_weights=`` (:func:`master_weight_mode`) and built by
:func:`build_master`; every mode has the same interface, which is all
:class:`~mixprec.LossScaleOptimizer` knows of it::

    grads_to_masters()      # before unscaling: gradients go where the step reads them
    masters_to_model()      # after the step: the model's parameters get the result
    zero_grad(set_to_none), add_param_group(group), state_dict(), load_state_dict(state)
    model_params            # the model's own parameters, in group order

The modes (bytes per parameter with AdamW, parameter included):

* ``"fp32"`` - :class:`MasterWeights`: float32 copies, stepped, copied back (14).
* ``"split"`` - :class:`SplitMasterWeights`: the bfloat16 weight plus the master's
  low 16 bits, rebuilt bit for bit for the step (12); equal to ``"fp32"``.
* ``"split8"`` - :class:`~mixprec.optim.Split8MasterWeights`: the bfloat16 weight plus
  an 8-bit correction in units of its last place (11, or 7 with
  :class:`~mixprec.optim.AdamW8bit`); the update runs in float32 on the rebuilt weight.
* ``"kahan"``/``"stochastic"`` - :class:`LeanUpdates`: the low-precision parameters
  are stepped, with a compensation buffer or stochastic rounding keeping the small
  updates (8 and 6); these also own the step (``step(found_inf, skip, weight_decay)``),
  since the update must land in their buffer.

Each class's docstring has the algorithm and an example.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from mixprec._checks import LOW_PRECISION, check_choice
from mixprec.numerics import dtensor_type, is_dtensor, is_flat_shard, local_shards
from mixprec.optim._flat_params import FlatParameters
from mixprec.optim._lean import LeanUpdates, stochastic_round

__all__ = [
    "MASTER_WEIGHT_MODES",
    "master_weight_mode",
    "build_master",
    "MasterWeights",
    "SplitMasterWeights",
    "LeanUpdates",
    "stochastic_round",
    "split_bits",
    "join_bits",
    "pack_bits",
    "unpack_bits",
    "bfloat16_bits32",
]


def _written(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """What changes when each of ``params`` is written: its version (in-place writes) and,
    for a plain tensor, where its data starts (``p.data = ...`` keeps the version but
    moves that). Runs on every parameter twice a step: the DTensor type is looked up once."""
    dtensor = dtensor_type()
    if dtensor is None:
        return [(p._version, p.data_ptr()) for p in params]
    return [(p._version, 0 if isinstance(p, dtensor) else p.data_ptr()) for p in params]


#: On a CPU, an unscaled step (bfloat16 O2) checks the masters' float32 gradient buffers
#: after the copy instead of the model's bfloat16 gradients before it
#: (:meth:`MasterWeights.gradients_to_check`): one norm per buffer over memory the copy
#: has just read, where a norm per parameter was the first to touch each gradient after
#: the backward. A GPU reads the bfloat16 gradients, half the bytes; the step-cost
#: benchmark, which prices a CPU run as a GPU one, turns this off while it counts.
CPU_FLAT_CHECK = True


class MasterWeights:
    """Swap ``optimizer``'s low-precision parameters for float32 masters (in place).

    Float32 master copies of low-precision parameters.

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

    #: The fused step (:meth:`fused_step`; docs/guides/master-weights.md, "The fused
    #: step"): ``None`` (the default) with ``torch.optim.AdamW(fused=True)`` on a GPU,
    #: ``True`` wherever ``torch.compile`` runs, ``False`` never.
    #: ``LossScaleOptimizer`` takes it on steps that need no float32 master gradients
    #: in memory: no ``unscale_()`` call, clipping option, gradient accumulation or loss
    #: scale other than 1 (bfloat16 without loss scaling).
    fused: bool | None = None

    #: What :meth:`fused_step` computes (a mode of ``_fused_lean._lean_adamw_math_``);
    #: ``None``: this mode has no fused step.
    _fused_mode: str | None = "fp32"

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
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
        self._versions: dict[int, tuple[int, int]] = {}  # the parameters as we wrote them
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
        params = [p for p, _ in self._low]
        self._versions = dict(zip(map(id, params), _written(params)))

    def adopt_model_edits(self) -> None:
        """Masters of model parameters written since the last copy (in place, or given new
        storage: ``p.data = ...``, ``Module.to``) take the new values.

        Elements whose low-precision value still equals the rounded master keep the
        master's extra bits, so re-loading the model's own checkpoint changes nothing.
        """
        now = _written([p for p, _ in self._low])
        changed = [(p, m) for (p, m), w in zip(self._low, now) if w != self._versions.get(id(p))]
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
        of one new float32 buffer per group: one allocation and one fused copy a step,
        not one cast kernel per parameter (DTensors, sharded, get their own casts).
        Model parameters written since the last step first hand their values to their
        masters (:meth:`adopt_model_edits`).
        """
        self.adopt_model_edits()
        dtensor = dtensor_type()  # once, not per parameter: this loop runs every step
        with torch.no_grad():
            for index, (models, masters) in enumerate(self._grouped()):
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
                    views = self._gradient_views(index, [m for _, m in missing])
                    for (grad, m), view in zip(missing, views):
                        m.grad = view
                        src.append(grad)
                        dst.append(view)
                if dst:
                    torch._foreach_copy_(local_shards(dst), local_shards(src))

    def _gradient_views(self, index: int, masters: list[torch.Tensor]) -> list[torch.Tensor]:
        """Float32 gradients for ``masters`` (group ``index``), views of one buffer: the
        views of the last step when they were made for the same masters (its storage
        grown back if zero_grad freed it), else new ones."""
        key = tuple((id(m), m.shape, m.device) for m in masters)
        cached = self._grad_views.get(index)
        if cached is not None and cached[0] == key:
            flat, views = cached[1], cached[2]
            storage = flat.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(flat.numel() * flat.element_size())
            return views
        sizes = [m.numel() for m in masters]
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=masters[0].device)
        views = [view.view_as(m) for view, m in zip(flat.split(sizes), masters)]
        if self.reuses_gradient_views:
            self._grad_views[index] = (key, flat, views)
        return views

    def gradients_to_check(self) -> list[torch.Tensor | None]:
        """After :meth:`grads_to_masters`, the tensors whose infs and NaNs are this step's:
        the model's gradients, which the masters' copy exactly in half the bytes; on a
        CPU (:data:`CPU_FLAT_CHECK`), the masters' gradient buffers where every view of
        one is a master's gradient now (one norm over a buffer the copy left in cache,
        not a norm per parameter, first to touch the gradients after the backward), the
        other masters' gradients, and the float32 parameters' own.

        >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        >>> masters = MasterWeights(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.bfloat16)
        >>> masters.grads_to_masters()
        >>> [t.shape for t in masters.gradients_to_check()]  # one buffer, not per parameter
        [torch.Size([3])]
        """
        if not (CPU_FLAT_CHECK and all(p.device.type == "cpu" for p in self.model_params)):
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

    def _free_gradient_views(self) -> None:
        """Drop the masters' gradients that are kept views and free their storage."""
        for _, flat, views in self._grad_views.values():
            kept = set(map(id, views))
            for m in self.masters:
                if id(m.grad) in kept:
                    m.grad = None
            flat.untyped_storage().resize_(0)

    def masters_to_model(self) -> None:
        """Copy the masters back into the model's low-precision parameters (fused)."""
        self.restore_model()
        with torch.no_grad():
            for models, masters in self._grouped():
                torch._foreach_copy_(local_shards(models), local_shards(masters))
        self._mark_model_current()

    # -- the fused step ---------------------------------------------------------------

    def fuses(self) -> bool:
        """Whether the next step can be the fused one (:attr:`fused`): this mode has
        one, its parameters are plain tensors (sharded masters copy shard to shard)
        and none shows its master (``unscale_()`` was not called)."""
        if self._fused_mode is None or self._shown or self._written:
            return False
        # (imported here: it imports the lean modes, which import this module)
        import mixprec.optim._fused_lean as _fused_lean

        mode = self._fused_mode
        return _fused_lean.wants_fused(self.optimizer, self.fused, mode) and self._fusable()

    def _fusable(self) -> bool:
        return not any(is_dtensor(p) or is_flat_shard(p) for p, _ in self._low)

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
        import mixprec.optim._fused_lean as _fused_lean
        from mixprec.optim._lean import kept_fractions

        if self._hypers is None:
            self._hypers = _fused_lean.HyperVectors()
        device = self.model_params[0].device if self.model_params else None
        kept = kept_fractions(self.optimizer, found_inf, skip, weight_decay, device)
        with torch.no_grad():
            skipped, verdict = _fused_lean.fused_adamw_step(
                self._fused_mode or "", self.optimizer, self._fused_entries(kept), found_inf,
                skip, self._hypers,
            )  # fmt: skip
        self._mark_model_current()
        return skipped, verdict

    def _fused_entries(self, kept: dict[int, torch.Tensor]) -> list[Any]:
        """:func:`~mixprec.optim._fused_lean.fused_adamw_step`'s entries: per parameter
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
        """Clear the model parameters' gradients (the masters' are overwritten each step)."""
        self.restore_model()
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()
        if set_to_none:
            self._free_gradient_views()

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


_TIE = 1 << 15


def bfloat16_bits32(weight: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of bfloat16 ``weight`` widened to float32: its 16 bits
    shifted up, which is what the float32 conversion does (NaN payloads included), in
    one kernel instead of a reinterpretation, a widening and a shift.

    >>> hex(int(bfloat16_bits32(torch.tensor([1.0], dtype=torch.bfloat16))))
    '0x3f800000'
    """
    return weight.float().view(torch.int32)


def split_bits(master: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int16 ``d``, one packed bit per element: is ``d`` ``+2**15``) for float32 ``master``
    and its round-to-nearest bfloat16 ``weight``.

    The tie bits are packed eight to a byte (uint8, ``ceil(n / 8)`` of them), so the split
    has a fixed size and never waits for the device (an index list of the ties would).

    >>> m = torch.tensor([1.0 + 2.0**-8, -3.0])  # a tie: halfway between two bfloat16s
    >>> d, ties = split_bits(m, m.bfloat16())
    >>> torch.equal(join_bits(m.bfloat16(), d, ties), m), ties.tolist()
    (True, [1])
    """
    diff = master.view(torch.int32) - bfloat16_bits32(weight)
    tie = pack_bits((diff == _TIE).flatten())
    return diff.to(torch.int16), tie  # +2**15 wraps to -2**15; the tie bits say where


def join_bits(weight: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The float32 master that :func:`split_bits` split (bit-exact)."""
    bits = bfloat16_bits32(weight) + low.to(torch.int32)
    tie = unpack_bits(ties, bits.numel()).view(bits.shape)
    bits += tie.to(torch.int32).mul_(2 * _TIE)  # -2**15 back
    return bits.view(torch.float32)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flat 0/1 ``bits`` (bool or any integer dtype) packed eight to a byte, the first in
    the lowest bit: ``ceil(n / 8)`` uint8, in three kernels (a shift by each bit's place
    and a sum over rows of eight, after the zero padding).

    >>> pack_bits(torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1])).tolist()
    [9, 1]
    """
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, -bits.numel() % 8))
    return (padded.view(-1, 8) << _bit_places(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` of :func:`pack_bits`'s bits, one uint8 0/1 each (flat).

    >>> unpack_bits(torch.tensor([9, 1], dtype=torch.uint8), 9).tolist()
    [1, 0, 0, 1, 0, 0, 0, 0, 1]
    """
    return (packed.unsqueeze(1) >> _bit_places(packed.device)).bitwise_and_(1).flatten()[:n]


_PLACES: dict[torch.device, torch.Tensor] = {}


def _bit_places(device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., 7]`` as uint8 on ``device`` (made once per device)."""
    if device not in _PLACES:
        _PLACES[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _PLACES[device]


class SplitMasterWeights(MasterWeights):
    """:class:`MasterWeights` whose float32 masters live only during the step.

    Split float32 masters: the bfloat16 weight plus the master's low 16 bits beside it.

    A float32 number is a bfloat16 number (its high 16 bits) and 16 more bits. The
    model's bfloat16 weight is the master *rounded to nearest*, so its bits are the
    master's high half or one more; the difference ``d = bits(master) - bits(weight) << 16``
    lies in ``[-2**15, 2**15]`` and is kept as an int16 (``+2**15``, a tie rounded down,
    is the one value int16 lacks: one more bit per element, packed eight to a byte, says
    where it stands).
    Between steps only the weight and ``d`` exist; for the step the float32 master is
    rebuilt bit for bit, stepped, rounded back into the weight and split again::

        step:  master = float32(bits(weight) << 16 + d)   # exact
               inner.step(master)                          # float32 state, as with fp32 masters
               weight = round(master); d = bits(master) - bits(weight) << 16; free master

    So training is bit-identical to ``master_weights="fp32"`` while the masters cost 2
    bytes per parameter between steps instead of 4 (2.125 with the tie bits; AdamW: 12.125
    bytes, not 14).
    bfloat16 parameters only; not with sharded (DTensor) parameters or ``use_ema``.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    >>> opt = torch.optim.SGD([w], lr=2.0**-12)
    >>> split = SplitMasterWeights(opt)
    >>> w.grad = -torch.ones_like(w)
    >>> split.grads_to_masters(); opt.step(); split.masters_to_model()
    >>> split.masters[0].numel(), float(split.state_dict()["masters"][0][0])  # freed; exact
    (0, 1.000244140625)
    """

    mode = "split"
    _fused_mode: str | None = None  # the tie bits, eight to a byte, are not elementwise

    @classmethod
    def check(cls, optimizer: torch.optim.Optimizer) -> None:
        """Raise ``ValueError`` unless ``optimizer`` holds plain bfloat16 parameters to split
        (this mode's and the subclasses': the weight is the master rounded to bfloat16)."""
        MasterWeights.check(optimizer)
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            if p.dtype == torch.float16 or is_dtensor(p):
                raise ValueError(
                    f"master_weights={cls.mode!r} needs plain bfloat16 parameters (the weight "
                    f"is the master rounded), got a {'DTensor' if is_dtensor(p) else p.dtype} "
                    "one; use master_weights='fp32' for float16 or sharded parameters"
                )

    # The step ends by dropping the masters' gradients with the masters (_release): a
    # buffer kept for the next step would hold 4 bytes per parameter between steps.
    reuses_gradient_views = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.check(optimizer)
        super().__init__(optimizer)
        # Per (device, dtype) group of _grouped(): the low halves and ties of all its
        # masters, flat, so a step rebuilds and splits them in a few kernels, not a few
        # per parameter; and, while the masters live, the flat buffer they view.
        self._halves: list[Any] | None = None  # per group, what _split_flat kept
        self._live: list[torch.Tensor] | None = None
        # Per group, the model's weights as views of one flat tensor (FlatParameters;
        # not held where a weight has gaps in its storage): rebuilt and rounded in place.
        self._weights: list[FlatParameters] | None = None
        self._release()

    def add_param_group(self, group: dict[str, Any]) -> dict[str, Any]:
        self._rebuild()
        group = super().add_param_group(group)
        self._live = None  # the new masters are not in the flat buffers yet
        self._weights = None  # nor the new weights in the flat weights
        self._release()
        return group

    def _flat_weights(self) -> list[FlatParameters]:
        """Each group's model weights, flat (made views of one tensor on first use;
        released, so gathered and scattered, once code gives one new storage)."""
        if self._weights is None:
            self._weights = [FlatParameters(models) for models, _ in self._grouped()]
        if not self._shown:  # (while the model shows the masters, they are not moved)
            for weights in self._weights:
                weights.follow()
        return self._weights

    def _split_flat(self, flat: torch.Tensor, weights: torch.Tensor) -> Any:
        """What is kept of a group's flat float32 masters beside their rounded weights."""
        return split_bits(flat, weights)

    def _join_flat(self, weights: torch.Tensor, kept: Any) -> torch.Tensor:
        """The group's flat float32 masters from its flat weights and what was kept."""
        return join_bits(weights, *kept)

    def _rebuild(self) -> None:
        """Materialise the float32 masters from the weights and their low halves."""
        if self._halves is None:
            return
        flat_weights = self._flat_weights()  # may refuse a changed weight: before any change
        halves, self._halves = self._halves, None
        with torch.no_grad():
            self._live = []
            for (_, masters), weights, kept in zip(self._grouped(), flat_weights, halves):
                flat = self._join_flat(weights.current(), kept)
                for m, view in zip(masters, weights.views_of(flat)):
                    m.data = view  # laid out as its weight
                self._live.append(flat)

    def _release(self, rounded: list[torch.Tensor] | None = None) -> None:
        """Split the live masters into low halves and free their float32 storage;
        ``rounded`` holds each group's flat masters rounded to the weights' dtype, where
        the caller has them."""
        if self._halves is not None:
            return
        with torch.no_grad():
            halves = []
            for i, ((models, masters), weights) in enumerate(
                zip(self._grouped(), self._flat_weights())
            ):
                flat = (
                    self._live[i]
                    if self._live is not None
                    else weights.gather([m.detach() for m in masters])
                )
                # The weights are the masters rounded to nearest, as masters_to_model wrote.
                rounded_i = flat.to(models[0].dtype) if rounded is None else rounded[i]
                halves.append(self._split_flat(flat, rounded_i))
                empty = torch.empty(0, dtype=torch.float32, device=flat.device)  # shared
                for m in masters:
                    m.data = empty
                    m.grad = None
            self._halves, self._live = halves, None

    def grads_to_masters(self) -> None:
        self._rebuild()
        super().grads_to_masters()

    def masters_to_model(self) -> None:
        """Round the masters into the model once, in one kernel per group (into the
        weights' own flat storage, which the split then reads beside the masters), then
        release them."""
        self._rebuild()  # copy_ema_to_params and checkpoint loads come here directly
        assert self._live is not None
        self.restore_model()
        with torch.no_grad():
            rounded = []
            for (models, _), weights, flat in zip(self._grouped(), self._flat_weights(),
                                                  self._live):  # fmt: skip
                if weights.held:
                    rounded.append(weights.values.copy_(flat))
                else:
                    rounded.append(flat.to(models[0].dtype))
                    weights.scatter(rounded[-1])
        self._mark_model_current()
        self._release(rounded)

    def state_dict(self) -> dict[str, Any]:
        if self._halves is None:  # the masters are live
            return {"mode": self.mode, "masters": [m.detach().clone() for _, m in self._low]}
        joined: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for (_, masters), weights, kept in zip(self._grouped(), self._flat_weights(),
                                                   self._halves):  # fmt: skip
                flat = self._join_flat(weights.current(), kept)
                joined.update({id(m): v for m, v in zip(masters, weights.views_of(flat))})
        return {"mode": self.mode, "masters": [joined[id(m)] for _, m in self._low]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load exact masters: this mode's checkpoints or ``"fp32"``'s, interchangeably."""
        self._rebuild()
        super().load_state_dict(state)  # checks shapes, copies, rounds into the model, splits


MASTER_WEIGHT_MODES = (False, "fp32", "split", "split8", "kahan", "stochastic")


def master_weight_mode(
    value: Any,
) -> Literal[False, "fp32", "split", "split8", "kahan", "stochastic"]:
    """Normalise ``master_weights=``: ``True`` means ``"fp32"``; raise on anything else.

    >>> master_weight_mode(True), master_weight_mode("kahan"), master_weight_mode(False)
    ('fp32', 'kahan', False)
    """
    if value is True:
        return "fp32"
    if not isinstance(value, (bool, str)):
        raise TypeError(
            "master_weights must be True, False or one of 'fp32', 'split', 'split8', 'kahan', "
            f"'stochastic', "
            f"got {type(value).__name__} {value!r}"
        )
    return check_choice("master_weights", value, MASTER_WEIGHT_MODES,
                        hint="the README's lean training section says what each costs")  # fmt: skip


def build_master(inner_optimizer: torch.optim.Optimizer, master_weights: Any) -> Any:
    """The part that owns what is stepped: ``MasterWeights``, ``SplitMasterWeights``,
    ``Split8MasterWeights``, ``LeanUpdates``, or ``None`` (the model's parameters are
    stepped as they are)."""
    mode = master_weight_mode(master_weights)
    if mode == "split8":
        from mixprec.optim._split8 import Split8MasterWeights  # it builds on this module

        return Split8MasterWeights(inner_optimizer)
    if mode in ("fp32", "split"):
        return (MasterWeights if mode == "fp32" else SplitMasterWeights)(inner_optimizer)
    return LeanUpdates(inner_optimizer, mode) if mode else None
