"""Float32 master copies of low-precision parameters.

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

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
>>> opt = torch.optim.SGD([w], lr=1e-4)
>>> mw = MasterWeights(opt)
>>> opt.param_groups[0]["params"][0].dtype
torch.float32
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION
from mixprec.optim.distributed import is_dtensor, local_shards

__all__ = ["MasterWeights"]


class MasterWeights:
    """Swap ``optimizer``'s low-precision parameters for float32 masters (in place)."""

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

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.check(optimizer)
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
        return {**group, "params": masters}

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
        """
        with torch.no_grad():
            for models, masters in self._grouped():
                src, dst, missing = [], [], []
                for p, m in zip(models, masters):
                    if p.grad is None:
                        m.grad = None
                    elif m.grad is not None and m.grad.shape == p.grad.shape:
                        src.append(p.grad)
                        dst.append(m.grad)
                    elif is_dtensor(p.grad):
                        m.grad = p.grad.float()
                    else:
                        missing.append((p, m))
                if missing:
                    sizes = [m.numel() for _, m in missing]
                    flat = torch.empty(sum(sizes), dtype=torch.float32, device=missing[0][1].device)
                    for (p, m), view in zip(missing, flat.split(sizes)):
                        m.grad = view.view_as(m)
                        src.append(p.grad)
                        dst.append(m.grad)
                if dst:
                    torch._foreach_copy_(local_shards(dst), local_shards(src))

    def masters_to_model(self) -> None:
        """Copy the masters back into the model's low-precision parameters (fused)."""
        with torch.no_grad():
            for models, masters in self._grouped():
                torch._foreach_copy_(local_shards(models), local_shards(masters))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients (the masters' are overwritten each step)."""
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().clone() for _, m in self._low]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "masters" not in state:  # a lean mode's entry (mixprec.optim.lean)
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
