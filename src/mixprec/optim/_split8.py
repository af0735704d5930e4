"""The ``"split8"`` master-weight mode: a bfloat16 weight plus an 8-bit correction.

:class:`Split8MasterWeights` keeps, beside each bfloat16 weight, one int8 per element
that says where between the weight's neighbours the float32 master lay (3 bytes per
weight, about 24 bits). For the step the master is rebuilt in float32 from the two,
the inner optimizer computes and applies its update in float32, and the result is
rounded into the weight and split again. :func:`split8_bits` and :func:`join8_bits`
are the two halves of that split, with the error bound in :func:`join8_bits`.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.optim._compressed_adamw import AdamW8bit
from mixprec.optim._masters import SplitMasterWeights, bfloat16_bits32

__all__ = ["CORRECTION_STEP", "split8_bits", "join8_bits", "split8_error_bound",
           "Split8MasterWeights"]  # fmt: skip

#: float32 units in the last place per correction unit. 255 codes (-127..127) of 258
#: ulps each cover the 2**16 + 1 bit distances a round-to-nearest weight can be from
#: its master (-2**15..2**15) with at most 129 ulps of error, and code 0 is exact.
CORRECTION_STEP = 258


def split8_bits(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The int8 correction of float32 ``master`` over its bfloat16 ``weight``.

    ``d = bits(master) - bits(weight) << 16`` counts the float32 ulps from the weight
    (as rounded) to the master: ``-2**15 <= d <= 2**15`` when the weight is the master
    rounded to nearest (the sign and exponent range of bfloat16 are float32's, so
    zeros, subnormals and signs round into place). The correction is ``d`` in units of
    :data:`CORRECTION_STEP` ulps, rounded to nearest: about 1/254 of the weight's
    bfloat16 ulp. Codes outside -127..127 (a weight that is not the rounded master: inf
    from an overflowed master, NaN payloads) are clamped, so :func:`join8_bits` never
    leaves the weight's neighbourhood.

    >>> m = torch.tensor([1.0 + 2.0**-9, -3.0, 0.0])
    >>> split8_bits(m, m.bfloat16()).tolist()  # a quarter ulp up; exact; exact
    [64, 0, 0]
    """
    return _split8_codes(master, weight).to(torch.int8)


def _split8_codes(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`split8_bits` with the codes still float32 (whole numbers): a compiled step
    blends them with the old ones on a skip while they are floats (an int8 blend
    compiles to a scalar loop per vector on a CPU)."""
    # One fresh buffer, worked in place (on a CPU a fresh large buffer costs as much as
    # a pass over it: its pages are faulted in).
    d = bfloat16_bits32(weight)
    torch.sub(master.view(torch.int32), d, out=d)
    # floor((d + 129) / 258) in float32, 2-3x faster than integer floor division on a
    # CPU and equal to it: a sum below 2**24 is exact in float32 and its quotient is an
    # integer or at least 1/258 from one, so the rounded division floors alike; larger
    # sums are clamped to +-127 either way. Each element is converted where it lies.
    q = d.add_(CORRECTION_STEP // 2).view(torch.float32).copy_(d)
    return q.div_(CORRECTION_STEP).floor_().clamp_(-127, 127)


def join8_bits(weight: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The float32 master rebuilt from its bfloat16 ``weight`` and int8 ``correction``.

    **Error bound.** For a finite weight that is the master rounded to nearest, the
    rebuilt master is within 129 float32 ulps of the master, counted along the bit
    patterns: ``|bits(join8(w, split8(m, w))) - bits(m)| <= 129``. Both lie within half
    a bfloat16 ulp of ``w``, so in ``w``'s binade or (for ``w`` a power of two) the one
    below, where float32 ulps are no larger than ``ulp32(w)``; hence::

        |rebuilt - master| <= 129 * ulp32(w) = 129 * 2**-16 * ulp_bf16(w)   (< 0.002 ulp_bf16)
        |rebuilt - master| <= 129 * 2**-23 * |w|  (about 2**-16 relative; normal w)

    where ``ulp32(w)`` is the float32 spacing at ``|w|`` (``2**-149`` for zeros and
    subnormals). Values bfloat16 holds exactly (zeros of either sign included) come
    back exactly, and the rebuilt master rounds to ``w`` again (its distance stays
    below half a bfloat16 ulp), so splitting it again gives the same correction. An
    infinite weight (a master beyond bfloat16's range) comes back infinite, a NaN as NaN.
    A correction paired with another weight than its own (a model loaded after its
    optimizer) gives a value within half a bfloat16 ulp of that weight, never across zero.

    >>> w = torch.tensor([1.0], dtype=torch.bfloat16)
    >>> float(join8_bits(w, torch.tensor([64], dtype=torch.int8)))  # 1 + 64 * 258 * 2**-23
    1.0019683837890625
    """
    high = bfloat16_bits32(weight)
    offset = correction.to(torch.int32).mul_(CORRECTION_STEP)
    # A weight of +-0 with a correction pointing below zero (one split from another
    # weight: the model was loaded after the optimizer) stays +-0, not NaN.
    torch.maximum(offset, (high & 0x7FFFFFFF).neg_(), out=offset)
    return high.add_(offset).view(torch.float32)


def split8_error_bound(weight: torch.Tensor) -> torch.Tensor:
    """The bound of :func:`join8_bits` per element: ``129 * ulp32(weight)`` (float32).

    >>> split8_error_bound(torch.tensor([1.0, 0.0], dtype=torch.bfloat16)).tolist()
    [1.537799835205078e-05, 1.807675018979014e-43]
    """
    magnitude = weight.float().abs()
    above = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf")))
    return (above - magnitude) * 129


class Split8MasterWeights(SplitMasterWeights):
    """Float32-quality masters at 1 extra byte per weight: ``master_weights="split8"``.

    Master weights as the bfloat16 weight plus an 8-bit correction (24-bit masters).

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

    mode = "split8"

    # The fused step (:attr:`fused`) reads and writes each weight, int8 correction,
    # gradient and moment once: no float32 master or master gradient is built. With
    # AdamW8bit, the moments' codes and block scales too: no float32 moment either.
    _fused_mode = "split8"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        if type(optimizer) is AdamW8bit:
            self._fused_mode = "split8-8bit"

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
        mode = state.get("mode", "fp32") if isinstance(state, dict) else None
        if mode not in ("split8", "split", "fp32") or (
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
