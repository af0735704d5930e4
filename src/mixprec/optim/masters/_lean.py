"""``"kahan"`` and ``"stochastic"``: low-precision parameters stepped in place, the
small updates kept by a compensation buffer or by stochastic rounding."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Final

import torch

from mixprec._checks import LOW_PRECISION, check_bool, check_choice
from mixprec.kernels.adamw import COMPENSATED, STOCHASTIC_ROUNDING
from mixprec.kernels.bits import high_halves
from mixprec.kernels.compiled import compile_unsupported
from mixprec.kernels.rounding import add_rounding_noise_
from mixprec.loss_scale import step_or_skip
from mixprec.numerics import is_dtensor
from mixprec.optim._flat_params import FlatParameters
from mixprec.optim.masters._float32 import MasterWeights
from mixprec.optim.masters._fused import (
    HyperVectors,
    fused_adamw_step,
    fused_adamw_unsupported,
    kept_fractions,
    wants_fused,
)

#: The two modes of this family, as the registry names them.
KAHAN: Final = "kahan"
STOCHASTIC: Final = "stochastic"
# The weight format each mode's fused step updates (mixprec.kernels.adamw).
_FORMATS = {KAHAN: COMPENSATED, STOCHASTIC: STOCHASTIC_ROUNDING}


def _device_types(optimizer: torch.optim.Optimizer) -> set[str]:
    return {p.device.type for g in optimizer.param_groups for p in g["params"]}


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``optimizer`` decays ``group`` apart from its gradient update (AdamW's
    way), which the lean modes can fold into their rounding: torch's AdamW, a group with
    torch's ``decoupled_weight_decay``, or a class that says so (``AdamW8bit``)."""
    return (
        isinstance(optimizer, torch.optim.AdamW)
        or bool(group.get("decoupled_weight_decay"))
        or getattr(type(optimizer), "decoupled_weight_decay", False) is True
    )


#: Most elements stepped together: the float32 sum of a run (4 bytes an element, at most
#: 256 MiB; stochastic rounding's noise 4 more) lives only during the step, and each run
#: costs a fixed handful of kernels, so a 150M-parameter model takes 3 runs.
RUN_ELEMENTS = 1 << 26


@dataclasses.dataclass
class _Run:
    """Consecutive low-precision parameters of one param group, device and dtype, stepped
    as one flat tensor (``loose``: a single non-contiguous parameter, stepped alone)."""

    params: list[torch.Tensor]
    loose: bool = False
    flat: torch.Tensor | None = None  # kahan: the storage of these parameters' buffers
    storage: FlatParameters | None = None  # the parameters as views of one flat tensor

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    """The values of contiguous ``params``, end to end, in one new tensor (one kernel)."""
    return torch.cat([p.view(-1) for p in params])


def _scatter(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Write ``flat`` (from :func:`_flat`) back into contiguous ``params`` (one kernel)."""
    torch.split_with_sizes_copy(flat, [p.numel() for p in params], out=[p.view(-1) for p in params])


class LeanUpdates:
    """Step ``optimizer``'s low-precision parameters in place with ``mode`` rounding:
    float32-like accuracy without float32 master weights.

    Stepping bfloat16 parameters directly loses every update smaller than half a unit in
    the last place (``|update| / |weight| < 2**-9``): the model stalls. Float32 masters fix
    that at 4 more bytes per parameter. The two lean modes fix it for 2 bytes or none:

    - ``"kahan"``: a low-precision compensation buffer ``c`` per parameter carries what the
      rounding of the last update lost (Kahan summation). 2 extra bytes per parameter.
    - ``"stochastic"``: the updated value is rounded up or down at random, with probability
      by distance, so updates are kept *on average*. No extra bytes; a seeded generator
      (checkpointed) makes runs reproducible. bfloat16 parameters only.

    Any inner optimizer whose update does not read the parameter's value (SGD, Adam,
    AdamW, RMSprop, Adagrad, ... with decoupled or no weight decay) works: for the step,
    each low-precision parameter's storage is swapped for a buffer (``c``, or zeros), so
    the inner optimizer adds its update there, where it is small and so kept with full
    relative precision, and its state (Adam's moments) is created in the parameter's
    dtype. Then, in float32, with decoupled weight decay folded in (``kept = 1 - lr *
    weight_decay``, 1 without decay; the product is never rounded to low precision)::

        total = p * kept + buffer              # the decayed value plus the exact-ish update
        kahan:      p = round(total);  c = total - p
        stochastic: p = stochastic_round(total)

    A step launches a fixed number of kernels, whatever the number of parameter tensors:
    consecutive contiguous parameters of one group, device and dtype form a run (up to
    :data:`RUN_ELEMENTS` elements) whose parameters are views of one flat tensor
    (docs/guides/master-weights.md, "One storage per group of weights").

    A skipped step leaves ``p`` and ``c`` exactly as they were. Bytes per parameter with
    AdamW (moments in the parameter dtype): kahan 2 + 2 + 4 = 8, stochastic 2 + 4 = 6
    (pure bfloat16 6, float32 12, float32 masters 14).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.full((4,), 1.0, dtype=torch.bfloat16))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> lean = LeanUpdates(opt, "kahan")
    >>> for _ in range(8):
    ...     w.grad = torch.full_like(w, -2.0**-10)  # each step alone rounds away in bfloat16
    ...     _ = lean.step(torch.zeros(()), skip=True)
    >>> float(w.detach()[0] + lean.compensation[0][0].float())  # 1 + 8 * 2**-10
    1.0078125

    With ``torch.optim.AdamW(fused=True)`` on a GPU (``fused=None``), or wherever
    ``fused=True`` asks, the step is one compiled elementwise function
    (:func:`~mixprec.kernels.adamw.kahan_adamw_`; docs/guides/master-weights.md, "The
    fused step"); ``fused=False`` never compiles.

    A :class:`~mixprec.optim.masters.Masters` of the registry (``master_weights="kahan"``
    or ``"stochastic"``): the same protocol as float32 masters, no copies.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: str,
        seed: int = 0,
        fused: bool | None = None,
    ) -> None:
        self.check(optimizer, mode)
        if fused is not None:
            check_bool("fused", fused, hint="or None (compiled with a fused AdamW on a GPU)")
        if fused:
            reason = fused_adamw_unsupported(optimizer, _FORMATS[mode]) or next(
                filter(None, map(compile_unsupported, _device_types(optimizer))), None
            )
            if reason:
                raise ValueError(
                    f"fused=True cannot run master_weights={mode!r} with this optimizer: "
                    f"{reason}; pass fused=None or False"
                )
        self.optimizer, self.mode, self.seed, self.fused = optimizer, mode, seed, fused
        self._format = _FORMATS[mode]
        self._hypers = HyperVectors()  # the fused step's hyperparameters
        self.model_params: list[torch.Tensor] = []
        self._low: list[torch.Tensor] = []
        self.compensation: list[torch.Tensor] = []
        self._generators: dict[str, torch.Generator] = {}
        self._runs: list[_Run] = []
        self._ones: dict[torch.device, torch.Tensor] = {}  # 1-element float32 ones
        for group in optimizer.param_groups:
            self._adopt(group["params"])

    @staticmethod
    def check(optimizer: torch.optim.Optimizer, mode: str) -> None:
        """Raise ``ValueError`` unless ``mode`` can step ``optimizer``; change nothing."""
        check_choice("mode", mode, tuple(_FORMATS))
        for group in optimizer.param_groups:
            LeanUpdates._check_group(optimizer, mode, group)
        if not any(p.dtype in LOW_PRECISION for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                f"master_weights={mode!r} needs float16 or bfloat16 parameters, but every "
                "parameter is float32; cast the model first or leave master_weights=False"
            )

    @staticmethod
    def _check_group(optimizer: torch.optim.Optimizer, mode: str, group: dict[str, Any]) -> None:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if group.get("weight_decay") and not _decoupled(optimizer, group):
            raise ValueError(
                f"master_weights={mode!r} cannot use {type(optimizer).__name__}'s "
                f"coupled weight_decay={group['weight_decay']} (it reads the parameter inside "
                "the step); set weight_decay=0 on the inner optimizer and pass "
                "LossScaleOptimizer(weight_decay=...), or use AdamW"
            )
        for p in params:
            if is_dtensor(p):
                raise ValueError(
                    f"master_weights={mode!r} does not support sharded (DTensor) "
                    "parameters; use master_weights='fp32' with FSDP2"
                )
            if mode == STOCHASTIC and p.dtype == torch.float16:
                raise ValueError(
                    "master_weights='stochastic' rounds to bfloat16, but a parameter is "
                    "float16; cast the model to bfloat16 or use master_weights='kahan'"
                )

    def _adopt(self, params: list[torch.Tensor]) -> None:
        """Take on one param group's parameters: cut its low-precision ones into runs."""
        runs: list[_Run] = []
        for p in params:
            self.model_params.append(p)
            if p.dtype not in LOW_PRECISION:
                continue  # float32 parameters (kept normalisation layers) step as they are
            self._low.append(p)
            key = str(p.device)
            # Only stochastic rounding draws random numbers; kahan saves no generator state.
            if self.mode == STOCHASTIC and key not in self._generators:
                self._generators[key] = torch.Generator(device=p.device).manual_seed(self.seed)
            last = runs[-1] if runs else None
            if not p.is_contiguous():
                runs.append(_Run([p], loose=True))
            elif (
                last is None
                or last.loose
                or (last.params[0].device, last.params[0].dtype) != (p.device, p.dtype)
                or last.numel + p.numel() > RUN_ELEMENTS
            ):
                runs.append(_Run([p]))
            else:
                last.params.append(p)
        for run in runs:
            if not run.loose:
                run.storage = FlatParameters(run.params)
            if self.mode != KAHAN:
                continue
            first = run.params[0]
            if run.loose:  # its own buffer, laid out as the parameter (and its gradient)
                run.flat = torch.zeros_like(first, memory_format=torch.preserve_format)
                self.compensation.append(run.flat)
                continue
            run.flat = torch.zeros(run.numel, dtype=first.dtype, device=first.device)
            self.compensation += [
                piece.view(p.shape)
                for piece, p in zip(run.flat.split([p.numel() for p in run.params]), run.params)
            ]
        self._runs += runs

    def add_param_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Check a new group and take on its parameters; return it unchanged."""
        self._check_group(self.optimizer, self.mode, group)
        params = group["params"]
        self._adopt([params] if isinstance(params, torch.Tensor) else list(params))
        return group

    # The parameters are what is stepped: nothing to copy either way.
    def grads_to_masters(self) -> None:
        """Before unscaling: a parameter whose dtype, shape, device or layout changed
        since the optimizer was built is refused here, before anything is unscaled or
        stepped; a run with a parameter given new storage (``p.data =``, ``Module.to``)
        is gathered and scattered from then on. The inner optimizer reads the
        parameters' own gradients: nothing is copied."""
        self._follow()

    def _follow(self) -> None:
        for run in self._runs:
            if run.storage is not None:
                run.storage.follow()

    def masters_to_model(self) -> None:
        """Nothing to do: :meth:`step` writes the parameters in place."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the inner optimizer's ``zero_grad`` clears the gradients."""

    stateful = True

    @property
    def option(self) -> str:
        """What ``LossScaleOptimizer.master_weights`` reports: the mode's name."""
        return self.mode

    def gradients_to_check(self) -> list[torch.Tensor | None]:
        """The parameters' own gradients: they are what is stepped."""
        return [p.grad for p in self.model_params]

    def show_masters_in_model(self) -> None:
        """Nothing to show: the parameters are what is stepped."""

    def restore_model(self) -> None:
        """Nothing shown, nothing to give back."""

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
        """The :meth:`fused_step` if ``fused``, else :meth:`eager_step` (which fuses by
        itself where it can: a verdict taken apart is no obstacle to it). Decay folds
        into the rounding (``applied`` is not needed). Returns (whether the host saw a
        skip, the verdict the step went by)."""
        if fused:
            return self.fused_step(found_inf, skip, weight_decay)
        assert found_inf is not None  # only a fused step checks the gradients itself
        return self.eager_step(found_inf, skip, weight_decay, step_kwargs), found_inf

    def eager_step(
        self,
        found_inf: torch.Tensor,
        skip: bool,
        weight_decay: float | None = None,
        step_kwargs: dict[str, Any] | None = None,
    ) -> bool:
        """The inner step with lean rounding (see the class docstring); ``weight_decay``
        is ``LossScaleOptimizer``'s decoupled decay. Returns whether the host saw a skip.

        A fixed number of kernels per run of parameters (:data:`RUN_ELEMENTS`), not per
        parameter: each run's flat storage is decayed and rounded in place in three
        (kahan: ``addcmul``, round, remainder), and float32 parameters are decayed by one
        foreach op.
        """
        if self._fuses(step_kwargs):
            return self.fused_step(found_inf, skip, weight_decay)[0]  # (it follows too)
        self._follow()
        with torch.no_grad():
            flats = self._buffers()
            if self.mode == KAHAN:  # views of the runs' flat storage, made once
                buffers = self.compensation
            else:
                buffers = [b for run in self._runs for b in self._views(run, flats[id(run)])]
            kept = self._kept_fractions(found_inf, skip, weight_decay)
            saved_decay = []
            for group in self.optimizer.param_groups:
                if id(group) in kept:  # float32 parameters decay here, low ones when rounded
                    self._decay_full(group["params"], kept[id(group)])
                if "weight_decay" in group:  # the inner optimizer would decay the buffers
                    saved_decay.append((group, group["weight_decay"]))
                    group["weight_decay"] = 0.0
            # What each parameter is between steps (runs hold their parameters' views).
            originals = [v for run in self._runs for v in
                         (run.storage.views if run.storage and run.storage.held
                          else [p.data for p in run.params])]  # fmt: skip
            for p, b in zip(self._low, buffers):
                p.data = b
            try:
                _, skipped = step_or_skip(self.optimizer, found_inf, skip=skip, kwargs=step_kwargs)
            finally:
                for p, data in zip(self._low, originals):
                    p.data = data
                for group, decay in saved_decay:
                    group["weight_decay"] = decay
            if skipped:
                return True  # nothing was stepped or decayed
            for run in self._runs:
                self._round(run, flats[id(run)], kept.get(id(run.params[0])))
        return False

    def _fuses(self, step_kwargs: dict[str, Any] | None) -> bool:
        """Whether this step is the fused one (see the class docstring)."""
        if step_kwargs:
            return False
        return bool(wants_fused(self.optimizer, self.fused, self._format))

    def fuses(self) -> bool:
        """Whether the next step (without keyword arguments) is the fused one."""
        return self._fuses(None)

    def fused_step(
        self, found_inf: torch.Tensor | None, skip: bool, weight_decay: float | None
    ) -> tuple[bool, torch.Tensor | None]:
        """The step as one compiled function per device; returns (whether the host saw
        a skip, only when a first step would create state; the verdict the step went
        by). ``found_inf`` ``None`` has the step check the gradients itself (``skip``
        must be true), as :meth:`MasterWeights.fused_step`. Stochastic
        rounding draws one seed a step per device from its generator and hashes it into
        each element's noise (:func:`~mixprec.kernels.rounding.hashed_bits`)."""
        self._follow()
        device = self._low[0].device if self._low else None
        kept = kept_fractions(self.optimizer, found_inf, skip, weight_decay, device)
        if self.mode == KAHAN:
            extras: dict[int, Any] = dict(zip(map(id, self._low), self.compensation))
        else:
            seeds = {
                key: torch.randint(0, 1 << 31, (1,), generator=g, device=g.device)
                for key, g in self._generators.items()
            }  # fmt: skip
            extras = {id(p): seeds[str(p.device)] for p in self._low}
        entries = [
            (group, p, p.data, extras.get(id(p)), p.grad, kept.get(id(p)))
            for group in self.optimizer.param_groups for p in group["params"]
            if p.grad is not None
        ]  # fmt: skip
        with torch.no_grad():
            return fused_adamw_step(
                self._format, self.optimizer, entries, found_inf, skip, self._hypers)  # fmt: skip

    def _one(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return one

    def _kept_fractions(
        self, found_inf: torch.Tensor, skip: bool, weight_decay: float | None
    ) -> dict[int, torch.Tensor]:
        return kept_fractions(self.optimizer, found_inf, skip, weight_decay)

    def _buffers(self) -> dict[int, torch.Tensor]:
        """Each run's buffer storage for this step: kahan's compensation, or zeros."""
        flats = {}
        for run in self._runs:
            if run.flat is not None:
                flats[id(run)] = run.flat
            elif run.loose:
                flats[id(run)] = torch.zeros_like(run.params[0])
            else:
                first = run.params[0]
                flats[id(run)] = torch.zeros(run.numel, dtype=first.dtype, device=first.device)
        return flats

    @staticmethod
    def _views(run: _Run, flat: torch.Tensor) -> list[torch.Tensor]:
        """The run's per-parameter buffers: views of its flat storage, shaped like each."""
        if run.loose:
            return [flat]
        pieces = flat.split([p.numel() for p in run.params])
        return [piece.view(p.shape) for piece, p in zip(pieces, run.params)]

    def _decay_full(self, params: list[torch.Tensor], kept: torch.Tensor) -> None:
        """Decoupled decay of the float32 ``params`` that have gradients, in place (the
        inner optimizer's decay is off; the low-precision ones decay in :meth:`_round`)."""
        low = {id(p) for p in self._low}
        full: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None and id(p) not in low:
                full.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), group in full.items():
            torch._foreach_mul_(group, kept.to(device, dtype).view(()))

    def _round(self, run: _Run, flat: torch.Tensor, kept: torch.Tensor | None) -> None:
        """``total = p * kept + b`` in float32 (``kept``: what decoupled decay keeps of
        parameters with gradients, ``None`` without decay), then kahan's ``p =
        round(total); b = total - p`` or stochastic rounding of ``total`` into ``p``, for
        every parameter of the run (stochastic: those with gradients, drawing their noise
        in order)."""
        members = run.params
        if self.mode == STOCHASTIC:
            members = [p for p in members if p.grad is not None]
        if not members:
            return
        whole = len(members) == len(run.params)
        if run.loose:
            values, buffer = members[0], flat
        elif whole:  # the parameters' own flat storage, read and written in place (if held)
            assert run.storage is not None
            values, buffer = run.storage.current(), flat
        else:  # stochastic, some without gradients: just the others, gathered
            views = dict(zip(map(id, run.params), self._views(run, flat)))
            values = _flat(members)
            buffer = torch.cat([views[id(p)].view(-1) for p in members])
        total = self._total(values, buffer, members, kept)
        if self.mode == KAHAN:
            values.copy_(total)
            torch.sub(total, values, out=flat)  # c = total - p, rounded once into the buffer
            if not (run.loose or run.storage is None or run.storage.held):
                _scatter(values, members)
            return
        # stochastic_round over the members: one draw of noise, in parameter order, and
        # the noisy float32 values truncated into the weights
        bits = total.view(torch.int32)
        add_rounding_noise_(bits, self._generators[str(bits.device)])
        values.view(torch.int16).copy_(high_halves(bits))
        if not (run.loose or (whole and run.storage is not None and run.storage.held)):
            _scatter(values, members)

    def _total(
        self,
        values: torch.Tensor,
        buffer: torch.Tensor,
        members: list[torch.Tensor],
        kept: torch.Tensor | None,
    ) -> torch.Tensor:
        """``values * kept + buffer`` in float32 (one ``addcmul``: ``kept`` is 1-D, so the
        low-precision operands are promoted), ``kept`` only for members with gradients
        (1 for the others), ``values`` and ``buffer`` holding ``members`` end to end."""
        device = values.device
        one = self._one(device)
        kept = one if kept is None else kept.to(device)
        factors = [kept if p.grad is not None else one for p in members]
        if all(f is factors[0] for f in factors):
            return torch.addcmul(buffer, values, factors[0])
        # Some members have no gradient (and so no decay): a slice per stretch of either.
        total = torch.empty(values.shape, dtype=torch.float32, device=device)
        start = 0
        for _, stretch in itertools.groupby(zip(factors, members), key=lambda fp: id(fp[0])):
            pairs = list(stretch)
            end = start + sum(p.numel() for _, p in pairs)
            torch.addcmul(buffer[start:end], values[start:end], pairs[0][0], out=total[start:end])
            start = end
        return total

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "compensation": [c.detach().clone() for c in self.compensation],
            "generators": {k: g.get_state() for k, g in self._generators.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("mode") if isinstance(state, dict) else None
        if saved != self.mode:
            saved = saved or MasterWeights.mode  # float32 masters' entries name no mode
            raise ValueError(
                f"the checkpoint's master weights are {saved!r}, this optimizer's "
                f"are {self.mode!r}; build the optimizer with master_weights={saved!r}"
            )
        # Older kahan checkpoints carry a generator state it never used: ignored.
        comp = state["compensation"]
        gens = state.get("generators", {}) if self.mode == STOCHASTIC else {}
        if (
            len(comp) != len(self.compensation)
            or any(s.shape != c.shape for s, c in zip(comp, self.compensation))
            or set(gens) != set(self._generators)
        ):
            raise ValueError("lean master-weight state does not match the optimizer's parameters")
        with torch.no_grad():
            for s, c in zip(comp, self.compensation):
                c.copy_(s)
        for key, g in self._generators.items():
            g.set_state(gens[key].cpu())  # a state map_location moved to a GPU
