"""Split float32 masters: the bfloat16 weight plus the master's low 16 bits beside it.

A float32 number is a bfloat16 number (its high 16 bits) and 16 more bits. The
model's bfloat16 weight is the master *rounded to nearest*, so its bits are the
master's high half or one more; the difference ``d = bits(master) - bits(weight) << 16``
lies in ``[-2**15, 2**15]`` and is kept as an int16 (``+2**15``, a tie rounded down,
is the one value int16 lacks: those rare positions are kept as a short index list).
Between steps only the weight and ``d`` exist; for the step the float32 master is
rebuilt bit for bit, stepped, rounded back into the weight and split again::

    step:  master = float32(bits(weight) << 16 + d)   # exact
           inner.step(master)                          # float32 state, as with fp32 masters
           weight = round(master); d = bits(master) - bits(weight) << 16; free master

So training is bit-identical to ``master_weights="fp32"`` while the masters cost 2
bytes per parameter between steps instead of 4 (AdamW: 2 + 2 + 8 = 12 bytes, not 14).
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

from __future__ import annotations

from typing import Any

import torch

from mixprec.optim.distributed import is_dtensor
from mixprec.optim.master_weights import MasterWeights

__all__ = ["SplitMasterWeights", "split_bits", "join_bits"]

_TIE = 1 << 15


def split_bits(master: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int16 ``d``, flat indices where ``d`` is ``+2**15``) for float32 ``master`` and
    its round-to-nearest bfloat16 ``weight``.

    >>> m = torch.tensor([1.0 + 2.0**-8, -3.0])  # a tie: halfway between two bfloat16s
    >>> d, ties = split_bits(m, m.bfloat16())
    >>> torch.equal(join_bits(m.bfloat16(), d, ties), m), ties.tolist()
    (True, [0])
    """
    high = weight.view(torch.int16).to(torch.int32) << 16
    diff = master.view(torch.int32) - high
    ties = torch.nonzero(diff.flatten() == _TIE).flatten()
    return diff.to(torch.int16), ties  # +2**15 wraps to -2**15; ``ties`` says which


def join_bits(weight: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The float32 master that :func:`split_bits` split (bit-exact)."""
    bits = (weight.view(torch.int16).to(torch.int32) << 16) + low.to(torch.int32)
    if ties.numel():
        bits.view(-1)[ties] += 2 * _TIE  # -2**15 back to +2**15
    return bits.view(torch.float32)


class SplitMasterWeights(MasterWeights):
    """:class:`MasterWeights` whose float32 masters live only during the step."""

    mode = "split"

    @staticmethod
    def check(optimizer: torch.optim.Optimizer) -> None:
        MasterWeights.check(optimizer)
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            if p.dtype == torch.float16 or is_dtensor(p):
                raise ValueError(
                    "master_weights='split' needs plain bfloat16 parameters (the weight is the "
                    f"master's high half), got a {'DTensor' if is_dtensor(p) else p.dtype} one; "
                    "use master_weights='fp32'"
                )

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.check(optimizer)
        super().__init__(optimizer)
        self._split: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._release()

    def add_param_group(self, group: dict[str, Any]) -> dict[str, Any]:
        group = super().add_param_group(group)
        self._release()
        return group

    def _rebuild(self) -> None:
        """Materialise the float32 masters from the weights and their low halves."""
        with torch.no_grad():
            for p, m in self._low:
                if id(m) in self._split:
                    low, ties = self._split.pop(id(m))
                    m.data = join_bits(p.detach(), low, ties)

    def _release(self) -> None:
        """Split the live masters into low halves and free their float32 storage."""
        with torch.no_grad():
            for p, m in self._low:
                if id(m) not in self._split:
                    self._split[id(m)] = split_bits(m.detach(), p.detach())
                    m.data = torch.empty(0, dtype=torch.float32, device=m.device)
                    m.grad = None

    def grads_to_masters(self) -> None:
        self._rebuild()
        super().grads_to_masters()

    def masters_to_model(self) -> None:
        self._rebuild()  # copy_ema_to_params and checkpoint loads come here directly
        super().masters_to_model()
        self._release()

    def state_dict(self) -> dict[str, Any]:
        masters = []
        for p, m in self._low:
            low, ties = self._split.get(id(m), (None, None))
            masters.append(m.detach().clone() if low is None else join_bits(p.detach(), low, ties))
        return {"mode": self.mode, "masters": masters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load exact masters: this mode's checkpoints or ``"fp32"``'s, interchangeably."""
        self._rebuild()
        super().load_state_dict(state)  # checks shapes, copies, rounds into the model, splits
