"""Steps that agree across ranks: ``torch.distributed`` support for the optimizer wrappers.

Under data parallelism (DDP, FSDP) every rank runs the same step on its own part of
the work. A step that one rank skips and another applies leaves the ranks with
different parameters and different loss scales, silently, for the rest of the run.
So the found-inf flag is all-reduced with ``MAX`` before anything is applied, and
every rank then skips or applies together and holds the same scale::

    found_inf = unscale_and_check_(grads, inv_scale)   # this rank's gradients
    all_reduce(found_inf, MAX, group=process_group)    # any rank's overflow is everyone's
    step unless found_inf; loss_scale.update(found_inf)

``process_group`` (of :class:`~mixprec.optim.LossScaleOptimizer` and
:class:`~mixprec.optim.GradScaler`):

* ``None`` (default): the default process group, whenever ``torch.distributed`` is
  initialised with more than one rank; nothing is sent otherwise.
* a ``ProcessGroup``: that group, e.g. the data-parallel group when tensor or
  pipeline parallelism splits the model over other ranks (or the shard group under
  FSDP's hybrid sharding).
* ``"local"``: no all-reduce; each rank decides alone. For ranks that train
  independently; under data parallelism this lets ranks drift apart.

The all-reduce moves one float. On NCCL it is queued on the device like the step
itself, so a fused inner optimizer still steps without a host sync; on gloo (CPU)
it is a blocking exchange of four bytes.

Sharded parameters: FSDP2 (``fully_shard``) parameters and gradients are DTensors;
norms taken for clipping are the full model's (DTensor reduces them across its
mesh), and master weights and EMA copy local shards (torch has no DTensor rule for
``_foreach_copy_``). FSDP1 (``FullyShardedDataParallel``) flat parameters are plain
tensors holding this rank's slice: global-norm clipping sums their squares over
``process_group``; per-tensor ``clipnorm`` cannot be computed on a slice and raises
``NotImplementedError``.

Gradient accumulation with ``no_sync()`` (DDP or FSDP2): wrap every micro-step's
backward in :meth:`DistributedSteps.no_sync`; it skips the gradient all-reduce on
all but the window's last micro-step, and that one reduces the whole window::

    opt = LossScaleOptimizer(inner, gradient_accumulation_steps=4)
    for x, y in loader:
        with opt.no_sync(ddp_model):
            opt.scale_loss(loss_fn(ddp_model(x), y)).backward()
        opt.step()          # applies once per 4 micro-steps: the large batch's mean
        opt.zero_grad()

>>> agree_on_found_inf(torch.tensor(1.0), None)   # no process group: nothing to agree with
tensor(1.)
>>> check_process_group("everyone")
Traceback (most recent call last):
...
TypeError: process_group must be None, 'local' or a torch.distributed ProcessGroup, got 'everyone'; ...
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mixprec.numerics import global_norm

__all__ = [
    "LOCAL",
    "DistributedSteps",
    "agree_on_found_inf",
    "check_process_group",
    "check_sharded_options",
    "is_dtensor",
    "local_shards",
    "norm_across_ranks",
    "reduction_group",
]

#: ``process_group=LOCAL``: every rank decides alone whether to skip.
LOCAL = "local"


def check_process_group(process_group: Any) -> None:
    """Raise ``TypeError`` unless ``process_group`` is ``None``, ``"local"`` or a group."""
    if process_group is None or process_group == LOCAL:
        return
    if dist.is_available() and isinstance(process_group, dist.ProcessGroup):
        return
    raise TypeError(
        "process_group must be None, 'local' or a torch.distributed ProcessGroup, got "
        f"{process_group!r}; pass None to agree over all ranks, 'local' to decide per rank"
    )


def reduction_group(process_group: Any) -> Any:
    """The group to all-reduce over, or ``None`` when there is no other rank to agree with.

    ``torch.distributed``'s own convention: the returned ``dist.group.WORLD`` stands for
    the default group. Asked at every step (cheap host calls), so an optimizer built
    before ``init_process_group`` still agrees once the group exists.
    """
    if process_group == LOCAL or not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if process_group is None else process_group
    return group if dist.get_world_size(group) > 1 else None


def agree_on_found_inf(found_inf: torch.Tensor | None, process_group: Any) -> torch.Tensor | None:
    """All-reduce ``found_inf`` (a 0/1 float tensor, in place) with ``MAX``; return it.

    ``None`` (an accumulation window that is not full) passes through unchanged.
    """
    group = None if found_inf is None else reduction_group(process_group)
    if group is not None:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


# -- sharded tensors ---------------------------------------------------------------------


def _dtensor_type() -> type | None:
    # Only imported once something else has: no DTensor can exist before that.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 parameter or gradient)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (sharing its storage), other tensors as they are.

    For copies between tensors that are sharded alike (a parameter and its float32
    master or moving average): ``torch._foreach_copy_`` on the shards is the same copy,
    fused, where torch has no DTensor rule for it.
    """
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor reduced to an ordinary tensor (a collective if it is partial)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def is_flat_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` is (a view of) an FSDP1 flat parameter: this rank's slice of many."""
    return getattr(param, "_fsdp_flattened", False) is True and not is_dtensor(param)


def _refuse_clipnorm_on_flat_shards(clipnorm: Any) -> None:
    raise NotImplementedError(
        f"clipnorm={clipnorm!r} with FSDP1 (FullyShardedDataParallel) flat parameters: "
        "each rank holds a slice of many tensors joined together, so no tensor's own "
        "norm is known; use global_clipnorm=, or FSDP2 (fully_shard), whose DTensor "
        "parameters clip per tensor"
    )


def check_sharded_options(optimizer: torch.optim.Optimizer, clipnorm: Any) -> None:
    """Raise ``NotImplementedError`` for options that sharded parameters cannot support."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if clipnorm is not None and any(is_flat_shard(p) for p in params):
        _refuse_clipnorm_on_flat_shards(clipnorm)


def norm_across_ranks(
    grads: list[torch.Tensor], shards: list[torch.Tensor] = (), process_group: Any = None
) -> torch.Tensor:
    """The L2 norm of all gradients of the model, where parts of it live on other ranks.

    ``grads``: ordinary tensors (whole on this rank) and DTensors (reduced across their
    mesh by DTensor). ``shards``: this rank's slices of tensors split over
    ``process_group`` (FSDP1 flat parameters): their squares are summed over the group.
    A float32 scalar; no host sync (a collective where anything is sharded).
    """
    if not shards and _dtensor_type() is None:  # nothing sharded: the plain norm
        return global_norm(grads) if grads else torch.zeros((), dtype=torch.float32)
    parts = []
    plain = [g for g in grads if not is_dtensor(g)]
    dtensors = [g for g in grads if is_dtensor(g)]
    if plain:
        parts.append(global_norm(plain))
    if dtensors:
        parts.append(_full(global_norm(dtensors)))
    if shards:
        squares = global_norm(shards).square()
        group = reduction_group(process_group)
        if group is not None:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
        parts.append(squares.sqrt())
    if len(parts) < 2:
        return parts[0] if parts else torch.zeros((), dtype=torch.float32)
    device = parts[0].device
    return torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]), 2.0)


# -- the optimizer's part ----------------------------------------------------------------


class DistributedSteps:
    """What :class:`~mixprec.optim.LossScaleOptimizer` does with other ranks (a mixin).

    It reads the optimizer's ``process_group``, ``clipvalue``/``clipnorm``/
    ``global_clipnorm`` and accumulation state; see the module docstring.
    """

    process_group: Any = None

    def _agree(self, found_inf: torch.Tensor | None) -> torch.Tensor | None:
        """All ranks' verdict on this step (``None``: inside an accumulation window)."""
        return agree_on_found_inf(found_inf, self.process_group)

    def _clip(self, params: list[torch.Tensor]) -> None:
        """Clip the gradients of ``params`` by the options set; norms are the whole model's."""
        from mixprec.optim.clipping import clip_gradients_

        if self.clipvalue is None and self.clipnorm is None and self.global_clipnorm is None:
            return
        flat = {id(p) for p, m in zip(params, self.model_params()) if is_flat_shard(m)}
        grads = [p.grad for p in params if p.grad is not None and id(p) not in flat]
        shards = [p.grad for p in params if p.grad is not None and id(p) in flat]
        if shards and self.clipnorm is not None:  # a group added after construction
            _refuse_clipnorm_on_flat_shards(self.clipnorm)
        with torch.no_grad():
            clip_gradients_(
                grads, self.clipvalue, self.clipnorm, self.global_clipnorm,
                shards=shards, process_group=self.process_group,
            )  # fmt: skip

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Around one micro-step's backward: skip ``model``'s gradient all-reduce unless
        the micro-step closes the accumulation window (the wrapper counts them).

        ``model`` is a ``DistributedDataParallel`` or an FSDP2 (``fully_shard``) module.
        Inside the window DDP's gradients are set aside after each backward (so the
        micro-step's ``step()`` and ``zero_grad()`` leave them alone) and put back before
        the next; FSDP2 keeps them itself. The last backward then reduces the window's
        sum once, and that ``step()`` applies its mean. The loss scale stays fixed
        within a window, so the sum is of equally scaled gradients.
        """
        accumulator = self.__dict__.get("_accumulator")
        if accumulator is None or accumulator.steps < 2:
            raise ValueError(
                "no_sync() is for gradient accumulation: build the optimizer with "
                "gradient_accumulation_steps=N (N >= 2), or call model.no_sync() yourself "
                "around backward passes whose gradients you sum in .grad"
            )
        last = accumulator.micro_step + 1 >= accumulator.steps
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield from self._ddp_micro_step(model, last)
        elif callable(getattr(model, "set_requires_gradient_sync", None)):  # FSDP2
            model.set_requires_gradient_sync(last)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        elif type(model).__name__ == "FullyShardedDataParallel":
            raise NotImplementedError(
                "opt.no_sync() with FSDP1 (FullyShardedDataParallel): FSDP1 keeps the "
                "skipped micro-steps' unsharded gradients in .grad itself; accumulate "
                "without no_sync (each micro-step then reduce-scatters), or use FSDP2 "
                "(fully_shard)"
            )
        else:
            raise TypeError(
                "no_sync(model) takes a DistributedDataParallel or an FSDP2 (fully_shard) "
                f"module, got {type(model).__name__}"
            )

    def _ddp_micro_step(self, model: torch.nn.Module, last: bool) -> Iterator[None]:
        params = [p for p in model.parameters() if p.requires_grad]
        held = self.__dict__.pop("_held_grads", None) or {}
        with torch.no_grad():
            for p in params:  # the window so far, summed in .grad by this backward
                if id(p) in held:
                    p.grad = held[id(p)] if p.grad is None else p.grad.add_(held[id(p)])
        if last:
            yield  # synchronised: DDP averages the window's sum over the ranks
            return
        with model.no_sync():
            yield
        self.__dict__["_held_grads"] = {id(p): p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        if self.__dict__.get("_held_grads"):
            raise RuntimeError(
                "state_dict() inside a no_sync() accumulation window: the window's "
                "gradients are not part of any state dict; save after the step() that "
                "ends the window"
            )
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self.__dict__.pop("_held_grads", None)  # a loaded state starts its own window
