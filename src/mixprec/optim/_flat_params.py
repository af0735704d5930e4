"""Parameters held as views of one flat tensor, so that one kernel reads or writes them all.

The lean and split master-weight modes round a whole group of low-precision
parameters at every step. With each parameter in its own storage that takes a gather
(``cat``) before and a scatter after; with the parameters made views of one flat tensor
(as FSDP's flat parameters are) the rounding reads and writes them in place.
:class:`FlatParameters` does that and keeps the model the truth: a parameter keeps its
identity, values and ``.grad``; code that later gives it new storage (``p.data = ...``,
``Module.to``) is followed by :meth:`FlatParameters.follow`, and a changed dtype, shape,
device or memory layout is refused with a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.numerics import is_flat_shard


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of its storage with no gaps or overlaps
    (contiguous, channels-last, transposed ...): then it can be a view of a flat block.

    >>> is_dense(torch.ones(2, 3).t()), is_dense(torch.ones(3, 1).expand(3, 4))
    (True, False)
    """
    if t.layout != torch.strided:
        return False
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _layout(p: torch.Tensor) -> tuple[Any, ...]:
    return (p.shape, p.stride(), p.dtype, p.device)


def _contiguous_layout(p: torch.Tensor) -> tuple[Any, ...]:
    return (p.shape, torch.empty(p.shape, device="meta").stride(), p.dtype, p.device)


def _describe(layout: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = layout
    return f"{dtype} {tuple(shape)} with strides {tuple(stride)} on {device}"


class FlatParameters:
    """``params`` (one device and dtype) as views of :attr:`values`, one flat tensor
    holding each parameter's elements in its memory order, end to end.

    Parameters with gaps or overlaps in their storage cannot be views of a flat tensor,
    and FSDP1's parameters live in its own buffers: with one of those (or
    ``hold=False``) nothing is held, and :meth:`gather` and
    :meth:`views_of` work in each parameter's logical order. Code that gives a held
    parameter new storage (``p.data = ...``, ``Module.to``, a sharding wrapper that
    points its parameters at its own buffers) may keep writing there, so the group is
    released (:attr:`held` becomes ``False``; the parameters keep the storage they were
    given) and its callers gather and scatter from then on, which is always right.

    >>> a = torch.nn.Parameter(torch.ones(2, 2))
    >>> b = torch.nn.Parameter(torch.zeros(3))
    >>> flat = FlatParameters([a, b])
    >>> flat.values.tolist(), a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0], True)
    >>> b.data = torch.full((3,), 2.0)  # new storage: released, gathered from now on
    >>> flat.follow(); flat.held, flat.gather([a, b]).tolist()
    (False, [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    """

    def __init__(self, params: list[torch.Tensor], hold: bool = True) -> None:
        if not params or len({(p.device, p.dtype) for p in params}) != 1:
            raise ValueError("FlatParameters needs parameters of one device and dtype")
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.layouts = [_layout(p) for p in self.params]  # checked by follow()
        dense = all(map(is_dense, self.params))
        # Where views_of() puts each parameter: its memory order, or its logical order.
        self._orders = self.layouts if dense else [_contiguous_layout(p) for p in self.params]
        #: Whether the parameters are views of :attr:`values` (else it is empty).
        self.held = False
        self.values = torch.empty(0, dtype=params[0].dtype)
        self.views: list[torch.Tensor] = []  # the parameters' storage while held
        self._addresses: list[int] = []
        # FSDP1 points its parameters at storage of its own (and keeps a reference to it):
        # moving them would leave its copy behind, so they are never held.
        if hold and dense and not any(map(is_flat_shard, self.params)):
            self.values = self.gather([p.detach() for p in self.params])
            self.views = self.views_of(self.values)
            with torch.no_grad():
                for p, view in zip(self.params, self.views):
                    p.data = view
            self._addresses = [p.data_ptr() for p in self.params]
            self.held = True

    def holds(self) -> bool:
        """Whether every parameter is still the view this made."""
        return self.held and all(p.data_ptr() == a for p, a in zip(self.params, self._addresses))

    def follow(self) -> None:
        """Before a step: raise ``ValueError`` (changing nothing) if a parameter's dtype,
        shape, device or layout is not what it was; release the group if code gave a
        parameter new storage."""
        if self.holds():
            return
        for p, was in zip(self.params, self.layouts):
            if _layout(p) != was:
                raise ValueError(
                    f"a parameter changed from {_describe(was)} to {_describe(_layout(p))} "
                    "after the optimizer was built; move, cast or convert the model first, "
                    "then build the optimizer (or call amp.initialize) again"
                )
        if self.held:
            self.held, self.values, self.views = False, self.values[:0], []

    def current(self) -> torch.Tensor:
        """The parameters as one flat tensor: :attr:`values` while held (written in
        place), else a gathered copy (to be :meth:`scatter`-ed back after writing)."""
        return self.values if self.held else self.gather([p.detach() for p in self.params])

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (one element per parameter element, any dtype) shaped as the
        parameters, each where :meth:`gather` puts it."""
        views, offset = [], flat.storage_offset()
        for (shape, stride, _, _), size in zip(self._orders, self.sizes):
            views.append(flat.as_strided(shape, stride, offset))
            offset += size
        return views

    def gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One new flat tensor holding ``tensors`` (shaped as the parameters, any dtype)
        where :meth:`views_of` sees them: one kernel when each is laid out that way
        (``cat`` of their storage blocks), else one copy per tensor."""
        if all(
            t.shape == s and t.stride() == st for t, (s, st, _, _) in zip(tensors, self._orders)
        ):
            return torch.cat([t.as_strided((n,), (1,)) for t, n in zip(tensors, self.sizes)])
        flat = torch.empty(sum(self.sizes), dtype=tensors[0].dtype, device=tensors[0].device)
        torch._foreach_copy_(self.views_of(flat), tensors)
        return flat

    def scatter(self, flat: torch.Tensor) -> None:
        """Write ``flat`` (laid out as :meth:`gather` makes it) into the parameters."""
        torch._foreach_copy_([p.detach() for p in self.params], self.views_of(flat))
