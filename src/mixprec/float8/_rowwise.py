"""Rowwise float8 scaling: one scale per row of each matmul operand (torchao's rowwise recipes).

A per-tensor scale is set by the tensor's single largest magnitude: one outlier row
(a token with a huge activation, a weight row far from the rest) pushes every other
row towards float8's subnormals, where it keeps few significant bits. Rowwise scaling
gives each row of a matmul operand its own scale, taken from that row's amax, so each
row uses float8's whole range. For ``y = x @ W^T`` a matmul reduces over the inner
dimension, and a scale can only be undone after the matmul if it is constant along
that dimension: one per row of the left operand, one per column of the right one.
Each tensor of a linear layer is therefore cast along the axis each matmul needs:

==============  ==========================  ====================================
matmul          left operand                right operand
==============  ==========================  ====================================
``y``           ``x``, a scale per row      ``W^T``, a scale per row of ``W``
``grad_x``      ``g``, a scale per row      ``W``, a scale per column of ``W``
``grad_W``      ``g^T``, per column of g    ``x``, a scale per column of ``x``
==============  ==========================  ====================================

(``g`` is the output gradient). All casts are float8_e4m3fn, the gradient's included,
and every scale is rounded down to a power of two (so scaling and unscaling are
exact). Two recipes, the names torchao gives them:

* ``"rowwise"`` (:class:`RowwiseScaling`): the table above, all three matmuls in float8;
* ``"rowwise_with_gw_hp"`` (:class:`RowwiseWithGwHpScaling`): ``y`` as above,
  ``grad_x`` from ``g`` per row against ``W`` with one scale for the whole tensor,
  and ``grad_W = g^T @ x`` in high precision (the most accurate of the float8
  recipes; the weight gradient costs a high-precision matmul).

The matmuls run through :func:`~mixprec.float8.scaled_mm`, which takes per-row scales
(``torch._scaled_mm``'s rowwise mode, or its float32 emulation). The casts the backward
needs from ``x`` and ``W`` are made by the forward and kept in float8 (``x`` itself is
kept for the high-precision weight gradient). Like dynamic scaling, the scales come
from the tensors being cast, so nothing is clipped; a non-finite value becomes NaN.

A rowwise scaling's buffers describe the tensor as a whole, for :func:`float8_stats`:
``amax`` is the largest row amax (the tensor's amax), ``scale`` the smallest row scale
(that of the row holding the amax), ``overflows`` counts casts with an inf/nan amax.
They are written by the cast each tensor gets first: the forward's for ``x`` and
``W``, the backward's first cast of ``g``.

>>> from mixprec.float8 import Float8Linear
>>> _ = torch.manual_seed(0)
>>> x = torch.randn(4, 32)
>>> x[0] *= 1e5                               # an outlier row
>>> w = torch.randn(16, 32)
>>> exact = x @ w.t()
>>> def error(recipe):
...     y = Float8Linear.from_linear(nn.Linear(32, 16, bias=False), recipe=recipe)
...     with torch.no_grad():
...         y.weight.copy_(w)
...         return float(((y(x) - exact)[1:].abs().max() / exact[1:].abs().max()))
>>> error("rowwise") < 0.1 < error("dynamic")   # the other rows keep their precision
True
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from mixprec.float8._matmul import scaled_mm
from mixprec.float8._scaling import RECIPES, DynamicScaling, Float8Scaling

#: ``torch._scaled_mm`` on GPUs needs the contracted dimension to be a multiple of this;
#: the token dimension, contracted in ``grad_W``, is padded to it with zeros.
_TOKEN_ALIGNMENT = 16


class _RowwiseCast(NamedTuple):
    """One rowwise cast: the float8 ``data``, and per slice its ``inv_scale``, ``amax`` and
    ``scale``."""

    data: torch.Tensor
    inv_scale: torch.Tensor
    amax: torch.Tensor
    scale: torch.Tensor


class RowwiseScaling(DynamicScaling):
    """Dynamic scaling with one scale per row (or column) of a matmul operand.

    One cast of a 2-D ``x`` along ``dim`` (``-1``: a scale per row; ``0``: per column;
    ``None``: one for the whole tensor)::

        amax = max(|x|, dim, keepdim)               # one per row (column)
        scale = fp8_max / max(amax, eps) / 2**margin, rounded down to 2**k
        data = float8(x * scale)                    # |x * scale| <= fp8_max: no clamp
        return data, 1 / scale                      # shaped to broadcast against data

    A row holding inf has scale 0 and one holding NaN a NaN scale, so its non-finite
    elements (all of it, for NaN) become NaN in float8 and the overflow reaches the loss
    scale's inf/nan check, with no extra pass to test for it.

    :class:`~mixprec.float8.Float8Linear` calls it through its rowwise matmul (module
    docstring); :meth:`cast` casts along the last dimension (a scale per row) and
    records the statistics (``amax``, ``scale``, ``overflows``; nothing is clipped, so
    ``saturated`` stays 0).

    Args:
        fp8_dtype: ``"e4m3"`` (the recipe's, for all three tensors) or ``"e5m2"``.
        margin: each scale is divided by ``2**margin``.
        power_of_2: round each scale down to a power of two (torchao's rowwise default).
        eps: lower bound of an amax (an all-zero row gets a finite scale).

    >>> s = RowwiseScaling("e4m3")
    >>> data, inv = s.cast(torch.tensor([[1.0, -3.0], [0.01, 0.02]]))
    >>> inv.flatten().tolist(), s.amax, s.scale
    ([0.0078125, 6.103515625e-05], tensor(3.), tensor(128.))
    >>> (data.float() * inv).tolist()          # 3 significant bits in each row
    [[1.0, -3.0], [0.009765625, 0.01953125]]
    """

    kind: ClassVar[str] = "rowwise"
    clips: ClassVar[bool] = False
    #: Whether the weight gradient is computed in high precision instead of float8.
    grad_weight_hp: ClassVar[bool] = False

    def __init__(self, fp8_dtype: Any = "e4m3", *, margin: float = 0, power_of_2: bool = True,
                 eps: float = 1e-12):  # fmt: skip
        super().__init__(fp8_dtype, margin=margin, power_of_2=power_of_2, eps=eps)
        if not self._bounded:
            # An all-zero row would get an infinite scale, and 0 * inf is NaN.
            raise ValueError(
                f"eps={eps!r} gives an all-zero row a scale beyond float32's range; pass a "
                "larger eps (e.g. 1e-12)"
            )

    def _cast_along(self, x: torch.Tensor, dim: int | None) -> _RowwiseCast:
        """A 2-D ``x`` cast with a scale per slice along ``dim`` (``None``: one scale); the
        scales and amaxes keep ``dim`` as size 1."""
        if x.numel():  # the inf-norm is max(|x|) in one op
            amax = torch.linalg.vector_norm(x, math.inf, dim=dim, keepdim=dim is not None,
                                            dtype=torch.float32)  # fmt: skip
        else:  # an empty reduction has no max; nothing is cast anyway
            shape = list(x.shape)
            if dim is not None:
                shape[dim] = 1
            amax = x.new_zeros(shape if dim is not None else (), dtype=torch.float32)
        scale = self._finish(torch.clamp(amax, min=self.eps))  # dynamic scaling's, per row
        # Each row's scale comes from that row's own amax, so no element lands beyond
        # fp8_max by more than float32 rounding (a few ulps, far below half a float8
        # step, which the cast rounds back to fp8_max): there is nothing to clamp. No
        # test for non-finite rows either (class docstring): inf * 0 and NaN stay NaN.
        data = (x.float() * scale).to(self.fp8_dtype)
        return _RowwiseCast(data, scale.reciprocal(), amax, scale)

    def _note(self, cast: _RowwiseCast) -> None:
        """Record a cast's statistics for the tensor as a whole (no host sync): the largest
        amax and the smallest scale (that of the amax's row)."""
        if cast.amax.numel():  # NaN and inf propagate: an overflow shows as such
            self._store(cast.scale.amin(), cast.amax.amax())

    def _cast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        cast = self._cast_along(rows, -1)
        self._note(cast)
        return cast.data.reshape(x.shape), cast.inv_scale

    def cast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(data, inv_scale)``: ``x`` in float8 with a scale per row (over the last
        dimension; leading dimensions are flattened into rows) and the ``(rows, 1)``
        inverse scales. Updates the statistics in place; no host sync."""
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            raise ValueError("x must have at least one dimension for a rowwise cast, got a 0-d tensor")
        return super().cast(x)


class RowwiseWithGwHpScaling(RowwiseScaling):
    """:class:`RowwiseScaling` whose layer computes the weight gradient in high precision.

    ``y`` is computed as with ``"rowwise"``; ``grad_x = g @ W`` from ``g`` with a scale per
    row and ``W`` with one scale; ``grad_W = g^T @ x`` from the unscaled high-precision
    tensors (torchao's ``ROWWISE_WITH_GW_HP``).

    >>> from mixprec.float8 import make_scaling
    >>> make_scaling("rowwise_with_gw_hp", "e4m3").grad_weight_hp
    True
    """

    kind: ClassVar[str] = "rowwise_with_gw_hp"
    grad_weight_hp: ClassVar[bool] = True


# The rows of the recipe table (:data:`mixprec.float8._scaling.RECIPES`) for these recipes.
RECIPES.update({cls.kind: cls for cls in (RowwiseScaling, RowwiseWithGwHpScaling)})


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of :data:`_TOKEN_ALIGNMENT`."""
    missing = -t.shape[0] % _TOKEN_ALIGNMENT
    return nn.functional.pad(t, (0, 0, 0, missing)) if missing else t


def _rowwise_scalings(*scalings: Float8Scaling) -> tuple[RowwiseScaling, ...]:
    for scaling in scalings:
        if not isinstance(scaling, RowwiseScaling):
            raise TypeError(
                f"a rowwise float8 layer needs rowwise scalings for its three tensors, got "
                f"{type(scaling).__name__}; build the layer with recipe='rowwise' or "
                "'rowwise_with_gw_hp' instead of replacing one scaling"
            )
    return scalings  # type: ignore[return-value]


class _RowwiseMatmul(torch.autograd.Function):
    """``x @ W^T`` with rowwise float8 operands in all three matmuls (module docstring).

    Operand layouts as ``torch._scaled_mm`` takes them: the first row-major, the second
    column-major (``B^T`` written row-major, read through ``.t()``); scales ``(M, 1)``
    for the first and ``(1, N)`` for the second.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, input_scaling: RowwiseScaling,
                weight_scaling: RowwiseScaling, grad_scaling: RowwiseScaling,
                out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        # Autograd records nothing inside forward and backward: no detach is needed.
        xr = input_scaling._cast_along(x, -1)
        wr = weight_scaling._cast_along(weight, -1)
        input_scaling._note(xr)
        weight_scaling._note(wr)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        hp = grad_scaling.grad_weight_hp
        saved: list[torch.Tensor | None] = [None, None, None, None]
        if need_x:  # W for grad_x = g @ W: a scale per column of W (one, with gw_hp)
            wc = weight_scaling._cast_along(weight, None if hp else 0)
            saved[0:2] = wc.data.t().contiguous(), wc.inv_scale
        if need_w:  # x for grad_W = g^T @ x: a scale per column of x (none, with gw_hp)
            if hp:
                saved[2] = x
            else:
                xc = input_scaling._cast_along(x, 0)
                saved[2:4] = _pad_tokens(xc.data).t().contiguous(), xc.inv_scale
        ctx.save_for_backward(*saved)
        ctx.grad_scaling = grad_scaling
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        w8 = wr.data.contiguous().t()
        return scaled_mm(xr.data, w8, xr.inv_scale, wr.inv_scale.view(1, -1), out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w_for_gx, w_inv, x_for_gw, x_inv = ctx.saved_tensors
        scaling: RowwiseScaling = ctx.grad_scaling
        g = grad_y
        grad_x = grad_w = None
        noted = False
        if w_for_gx is not None:  # grad_x = g @ W, g with a scale per row
            gr = scaling._cast_along(g, -1)
            scaling._note(gr)
            noted = True
            grad_x = scaled_mm(gr.data, w_for_gx.t(), gr.inv_scale, w_inv, ctx.x_dtype)
        if x_for_gw is not None and scaling.grad_weight_hp:  # grad_W = g^T @ x, unscaled
            # promote_types is a dispatched op: asked only where the dtypes differ.
            dtype = g.dtype
            if g.dtype != x_for_gw.dtype:
                dtype = torch.promote_types(g.dtype, x_for_gw.dtype)
            grad_w = (g.to(dtype).t() @ x_for_gw.to(dtype)).to(ctx.w_dtype)
        elif x_for_gw is not None:  # grad_W = g^T @ x, g with a scale per column
            gc = scaling._cast_along(g, 0)
            if not noted:
                scaling._note(gc)
            gc8t = _pad_tokens(gc.data).t().contiguous()
            grad_w = scaled_mm(gc8t, x_for_gw.t(), gc.inv_scale.view(-1, 1), x_inv, ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


def rowwise_matmul(x: torch.Tensor, weight: torch.Tensor, input_scaling: Float8Scaling,
                   weight_scaling: Float8Scaling, grad_scaling: Float8Scaling,
                   out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``x @ weight^T`` in ``out_dtype`` for 2-D ``x`` ``(M, K)`` and ``weight`` ``(N, K)``, with
    rowwise float8 operands forward and backward (the module docstring's table)."""
    scalings = _rowwise_scalings(input_scaling, weight_scaling, grad_scaling)
    y: torch.Tensor = _RowwiseMatmul.apply(x, weight, *scalings, out_dtype)
    return y
