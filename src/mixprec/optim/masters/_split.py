"""``"split"`` and ``"split8"``: float32 masters rebuilt for the step from the bfloat16
weight and 16 or 8 more bits kept beside it (:mod:`mixprec.kernels.bits`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mixprec.kernels.adamw import LOW_BITS8, LOW_BITS8_MOMENTS8
from mixprec.kernels.bits import join8_bits, join_bits, split8_bits, split_bits
from mixprec.numerics import is_dtensor
from mixprec.optim._adamw8bit import AdamW8bit
from mixprec.optim._flat_params import FlatParameters
from mixprec.optim.masters._float32 import MasterWeights

if TYPE_CHECKING:
    from mixprec.typing import MasterWeightsMode


class SplitMasterWeights(MasterWeights):
    """:class:`MasterWeights` whose float32 masters live only during the step: the
    bfloat16 weight plus the master's low 16 bits beside it.

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

    mode: ClassVar[MasterWeightsMode] = "split"
    option: bool | str = mode
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


class Split8MasterWeights(SplitMasterWeights):
    """Float32-quality masters at 1 extra byte per weight (``master_weights="split8"``):
    the bfloat16 weight plus an 8-bit correction (24-bit masters).

    :class:`SplitMasterWeights` keeps the float32 master's 16 low bits beside the
    bfloat16 weight and rebuilds it bit for bit; this mode keeps 8 of them (rounded:
    the int8 of :func:`split8_bits`) and rebuilds the master to within ``2**-16``
    relative (the bound is in :func:`join8_bits`). Around each step::

        step:  master = join8(weight, correction)   # float32, within 129 ulps
               inner.step(master)                    # the update computed in float32
               weight = round(master); correction = split8(master, weight); free master

    An update smaller than half a bfloat16 ulp is kept in the correction as long as it
    is larger than the correction's resolution (1/254 of the weight's ulp, about 2**-15
    relative; AdamW's updates are 2**-12 relative or more at usual learning rates);
    smaller updates round away, where float32 masters keep them down to 2**-24. Bytes per parameter between steps: weight 2 + correction 1 + the
    inner optimizer's state (AdamW: 8 in float32; :class:`~mixprec.optim.AdamW8bit`:
    2 and its block scales), against 2 + 4 + 8 for ``"fp32"``. During the eager step
    the float32 master and its gradient exist (8 bytes per stepped parameter); the
    fused step (:attr:`fused`, with ``AdamW`` or ``AdamW8bit``) builds neither.

    Everything else is :class:`SplitMasterWeights`'s: the model's parameters are the
    truth (edits and loads are adopted), ``unscale_()`` shows the masters in the model
    for clipping, bfloat16 parameters only, no DTensors, no ``use_ema``. Checkpoints
    hold the corrections (int8, so half the size of ``"split"``'s low halves); with the
    model's own checkpoint they restore the masters bit for bit, and ``"fp32"``/
    ``"split"`` checkpoints load too (their masters are rounded to this mode's).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    >>> opt = torch.optim.SGD([w], lr=2.0**-12)
    >>> split8 = Split8MasterWeights(opt)
    >>> for _ in range(4):  # each update is an eighth of a bfloat16 ulp at 1.0
    ...     w.grad = -torch.ones_like(w)
    ...     split8.grads_to_masters(); opt.step(); split8.masters_to_model()
    >>> master = join8_bits(w.detach(), split8.corrections[0])
    >>> float(w.detach()[0]), round(float(master[0]) - 1, 5), round(2.0**-10, 5)  # kept
    (1.0, 0.00098, 0.00098)
    """

    mode: ClassVar[MasterWeightsMode] = "split8"
    option: bool | str = mode

    # The fused step (:attr:`fused`) reads and writes each weight, int8 correction,
    # gradient and moment once: no float32 master or master gradient is built. With
    # AdamW8bit, the moments' codes and block scales too: no float32 moment either.
    _fused_mode = LOW_BITS8

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        if type(optimizer) is AdamW8bit:
            self._fused_mode = LOW_BITS8_MOMENTS8

    # The base class keeps one flat buffer per (device, dtype) group and rebuilds or
    # splits a whole group in a few kernels; this mode only changes what is kept.

    def _split_flat(self, flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return split8_bits(flat, weights)

    def _join_flat(self, weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return join8_bits(weights, kept)

    def _fusable(self) -> bool:
        """The masters released and every group's weights held in one flat tensor."""
        return self._halves is not None and all(w.held for w in self._flat_weights())

    def _fused_entries(self, kept: dict[int, torch.Tensor]) -> list[Any]:
        """Per parameter with a gradient: (group, master, the model's weight, its int8
        correction or ``None`` for a float32 parameter, its gradient, what decay keeps);
        the weights and corrections are stepped in place."""
        assert self._halves is not None
        parts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for (models, masters), weights, flat in zip(self._grouped(), self._flat_weights(),
                                                    self._halves):  # fmt: skip
            for p, m, q in zip(models, masters, weights.views_of(flat)):
                parts[id(m)] = (p, q)
        entries = []
        for group in self.optimizer.param_groups:
            for m in group["params"]:
                p, q = parts.get(id(m), (m, None))  # float32 parameters step as they are
                if p.grad is not None:
                    entries.append((group, m, p.data, q, p.grad, kept.get(id(m))))
        return entries

    @property
    def corrections(self) -> list[torch.Tensor]:
        """The int8 corrections of the released masters (views), in :attr:`masters`
        order; empty while the masters are live (during a step)."""
        if self._halves is None:
            return []
        views: dict[int, torch.Tensor] = {}
        for (_, masters), weights, flat in zip(self._grouped(), self._flat_weights(),
                                               self._halves):  # fmt: skip
            views.update(zip(map(id, masters), weights.views_of(flat)))
        return [views[id(m)] for _, m in self._low]

    def state_dict(self) -> dict[str, Any]:
        if self._halves is None:  # mid-step: the masters are live, the weights may show them
            with torch.no_grad():
                live = [m.detach() for _, m in self._low]
                corrections = [split8_bits(m, m.to(torch.bfloat16)) for m in live]
        else:
            corrections = [c.clone() for c in self.corrections]
        return {"mode": self.mode, "corrections": corrections}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this mode's corrections (bit-exact with the model's weights), or the
        float32 masters of an ``"fp32"``/``"split"`` checkpoint (rounded to this mode's).
        Everything is checked before anything changes."""
        mode = state.get("mode", MasterWeights.mode) if isinstance(state, dict) else None
        if mode not in (self.mode, SplitMasterWeights.mode, MasterWeights.mode) or (
            "corrections" not in state and "masters" not in state
        ):
            raise ValueError(
                f"the checkpoint's master weights are {mode!r}, this optimizer's are 'split8'; "
                f"build the optimizer with master_weights={mode!r}"
            )
        if "masters" in state:
            saved = state["masters"]
            if len(saved) != len(self._low) or any(
                not torch.is_tensor(s) or s.shape != p.shape for s, (p, _) in
                zip(saved, self._low)
            ):
                raise ValueError("master-weight state does not match the optimizer's parameters")
            super().load_state_dict(state)  # copies, rounds into the model, splits to 8 bits
            return
        saved = state["corrections"]
        if len(saved) != len(self._low):
            raise ValueError(
                f"the checkpoint has {len(saved)} split8 corrections, this optimizer has "
                f"{len(self._low)} bfloat16 parameters: was it saved from another model?"
            )
        for i, (s, (p, _)) in enumerate(zip(saved, self._low)):
            if not torch.is_tensor(s) or s.dtype != torch.int8 or s.shape != p.shape:
                got = f"{s.dtype} {tuple(s.shape)}" if torch.is_tensor(s) else type(s).__name__
                raise ValueError(
                    f"split8 correction {i} must be an int8 tensor of shape {tuple(p.shape)} "
                    f"(its parameter's), got {got}: was it saved from another model?"
                )
        # The corrections are relative to the model's weights, loaded before or after
        # this: only they are replaced (the model is not written), and the masters are
        # rebuilt from both at the next step.
        self.restore_model()
        by_master = {id(m): s for s, (_, m) in zip(saved, self._low)}
        with torch.no_grad():
            kept = []
            for (models, masters), weights in zip(self._grouped(), self._flat_weights()):
                saved_here = [by_master[id(m)].to(models[0].device) for m in masters]
                kept.append(weights.gather(saved_here))
                for m in masters:
                    m.data = torch.empty(0, dtype=torch.float32, device=m.device)
                    m.grad = None
        self._halves, self._live = kept, None
        self._mark_model_current()
