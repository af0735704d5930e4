"""Distributed checkpoints of a model and its ``LossScaleOptimizer`` (``torch.distributed.checkpoint``).

:class:`CheckpointState` is a DCP ``Stateful``: hand it to ``dcp.save`` and
``dcp.load`` and every rank writes and reads only its own shards, in parallel; a
loaded run continues exactly as the saved one would have (parameters, optimizer
state, loss scale and its counters, step counters, master weights, EMA)::

    import torch.distributed.checkpoint as dcp
    state = {"train": CheckpointState(model, opt)}
    dcp.save(state, checkpoint_id="ckpt/step1000")      # collective: every rank calls it
    ...
    dcp.load(state, checkpoint_id="ckpt/step1000")      # in place, on a freshly built run

The model may be plain, DDP, FSDP2 (``fully_shard``) or FSDP1. The model and the inner
optimizer's state go through torch's ``get_state_dict``/``set_state_dict`` (keys are
parameter names, DTensors stay sharded); ``state_dict()["mixprec"]``, which those
helpers drop, travels beside them. With ``master_weights=True`` the optimizer steps
float32 copies that torch's helpers cannot name, so its state dict is saved as it is
(sharded alike: the copies are DTensors under FSDP2). The loss scale and counters are
the same on every rank (their steps agree), so one copy of them is written.

Not supported (``NotImplementedError``, before anything is written): master weights,
EMA or a half-full accumulation window on FSDP1 flat parameters, whose per-rank slices
DCP would take for one replicated tensor; use FSDP2, or FSDP1's own ``MixedPrecision``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from mixprec._checks import check_instance
from mixprec.numerics import is_flat_shard
from mixprec.optim._loss_scale_optimizer import LossScaleOptimizer


def _refuse_flat_shard_parts(opt: LossScaleOptimizer) -> None:
    accumulating = opt._accumulator is not None and opt._accumulator.micro_step > 0
    parts = [
        name
        for name, present in (
            ("master weights", opt.master_weights),
            ("EMA", opt.use_ema),
            ("a half-full accumulation window", accumulating),
        )
        if present
    ]
    if parts and any(is_flat_shard(p) for p in opt.model_params()):
        raise NotImplementedError(
            f"a distributed checkpoint of {' and '.join(parts)} on FSDP1 flat parameters: "
            "each rank keeps its own slice in a plain tensor, which DCP would save as one "
            "replicated tensor; use FSDP2 (fully_shard), or FSDP1's MixedPrecision with "
            "float32 parameters instead of master weights"
        )


def _init_state(opt: LossScaleOptimizer) -> None:
    """Create the inner optimizer's state (a step at learning rate 0 on zero gradients),
    so that a freshly built optimizer offers ``dcp.load`` every entry a trained one saved.
    What it changes besides is overwritten by the load."""
    inner = opt.inner_optimizer
    # The stepped tensors (masters) whose model parameters train; masters never require grad.
    stepped = [p for g in inner.param_groups for p in g["params"]]
    params = [s for s, p in zip(stepped, opt.model_params()) if p.requires_grad]
    if inner.state or any(p.grad is not None for p in params):
        return
    lrs = [g["lr"] for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    try:
        inner.step()
    finally:
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None


class CheckpointState(Stateful):
    """A ``torch.distributed.checkpoint`` ``Stateful`` for a model and its optimizer.

    ``state_dict()`` and ``load_state_dict()`` are collectives under FSDP: call them (or
    ``dcp.save``/``dcp.load``) on every rank.
    """

    def __init__(self, model: torch.nn.Module, optimizer: LossScaleOptimizer) -> None:
        check_instance("model", model, torch.nn.Module, "a torch.nn.Module")
        check_instance(
            "optimizer", optimizer, LossScaleOptimizer, "a mixprec LossScaleOptimizer",
            hint="a plain torch optimizer goes through torch's get_state_dict directly",
        )  # fmt: skip
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        _refuse_flat_shard_parts(opt)
        if opt.master_weights:
            _init_state(opt)
            return {"model": get_model_state_dict(self.model), "optimizer": opt.state_dict()}
        own = opt.state_dict()["mixprec"]  # also refuses a no_sync window in flight
        model_sd, optim_sd = get_state_dict(self.model, opt.inner_optimizer)
        return {"model": model_sd, "optimizer": {**optim_sd, "mixprec": own}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        opt = self.optimizer
        if opt.master_weights:
            set_model_state_dict(self.model, state_dict["model"])
            opt.load_state_dict(state_dict["optimizer"])  # the masters, then the model
            return
        optim_sd = dict(state_dict["optimizer"])
        own = optim_sd.pop("mixprec")
        set_state_dict(
            self.model, opt.inner_optimizer,
            model_state_dict=state_dict["model"], optim_state_dict=optim_sd,
        )  # fmt: skip
        opt.load_state_dict({**opt.inner_optimizer.state_dict(), "mixprec": own})
