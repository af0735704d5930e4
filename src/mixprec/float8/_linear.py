"""``Float8Linear``: an ``nn.Linear`` whose three matmuls run in float8 with per-tensor scales.

Forward ``y = x @ W^T (+ b)``: ``x`` and ``W`` are cast to float8_e4m3fn, each with
its own scale, and multiplied by ``torch._scaled_mm``, which undoes both scales and
writes ``y`` in high precision. Backward: the output gradient is cast to
float8_e5m2 (two more exponent bits: gradients span a wider range) with a third
scale, then ``grad_x = grad_y @ W`` and ``grad_W = grad_y^T @ x`` are two more
scaled matmuls against the float8 copies saved by the forward. The bias is added,
and its gradient computed, in high precision. On a device without a float8 matmul
the same products are emulated in float32 (:mod:`mixprec.float8._matmul`).

>>> _ = torch.manual_seed(0)
>>> layer = Float8Linear(32, 16, recipe="delayed", history_len=4)
>>> x = torch.randn(2, 5, 32, requires_grad=True)
>>> y = layer(x); y.sum().backward()
>>> y.shape, x.grad.shape, layer.weight.grad.shape
(torch.Size([2, 5, 16]), torch.Size([2, 5, 32]), torch.Size([16, 32]))
>>> ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
>>> bool((y - ref).abs().max() < 0.1 * ref.abs().max())
True
>>> layer.grad_scaling.amax_history[0] > 0     # the backward recorded its amax
tensor(True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._checks import as_dtype
from mixprec.float8._matmul import scaled_mm
from mixprec.float8._scaling import Float8Scaling, make_scaling

__all__ = ["Float8Linear"]

#: Output dtypes ``torch._scaled_mm`` can write.
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``torch._scaled_mm`` on GPUs needs every contracted and output dimension to be a
#: multiple of this; the token dimension, contracted in ``grad_W``, is padded to it.
ALIGNMENT = 16
# Module state that hooks live in: moved to the float8 layer so no hook is lost.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
    "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


def _column_major(t: torch.Tensor) -> torch.Tensor:
    # The second operand of _scaled_mm must be column-major on GPUs.
    return t.t().contiguous().t()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of :data:`ALIGNMENT` (zeros add nothing)."""
    missing = -t.shape[0] % ALIGNMENT
    if not missing:
        return t
    return torch.cat((t, torch.zeros(missing, t.shape[1], dtype=t.dtype, device=t.device)))


class _Float8Matmul(torch.autograd.Function):
    """``x @ W^T`` from float8 copies; the backward casts ``grad_y`` to e5m2 and runs
    both gradient matmuls in float8. ``x`` and ``weight`` are inputs only so that their
    gradients are routed to them; the float8 copies are what is saved and used."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, x8: torch.Tensor,
                x_inv: torch.Tensor, w8: torch.Tensor, w_inv: torch.Tensor,
                grad_scaling: Float8Scaling, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.grad_scaling = grad_scaling
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return scaled_mm(x8, w8.t(), x_inv, w_inv, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        g8, g_inv = ctx.grad_scaling.cast(grad_y.contiguous())
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8, _column_major(w8), g_inv, w_inv, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_mm(_pad_rows(g8).t().contiguous(), _column_major(_pad_rows(x8)),
                               g_inv, x_inv, ctx.w_dtype)  # fmt: skip
        return grad_x, grad_w, None, None, None, None, None, None


class Float8Linear(nn.Linear):
    """A linear layer computed in float8 with per-tensor scaling (forward and backward).

    Pseudo-code of one training step::

        x8, x_inv = input_scaling.cast(x)        # float8_e4m3fn
        w8, w_inv = weight_scaling.cast(W)       # float8_e4m3fn
        y = scaled_mm(x8, w8^T) * x_inv * w_inv + b
        # backward
        g8, g_inv = grad_scaling.cast(grad_y)    # float8_e5m2
        grad_x = scaled_mm(g8, w8) * g_inv * w_inv
        grad_W = scaled_mm(g8^T, x8) * g_inv * x_inv

    The three scalings are submodules, so their buffers (scales, amax histories,
    saturation counts) are part of ``state_dict()`` and a reload resumes exactly.
    Inputs of any rank ``(..., in_features)`` work (leading dims are flattened).
    ``y`` is in ``output_dtype`` if given, else in the autocast dtype when autocast is
    on, else in the input's dtype. No host sync anywhere.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: ``"dynamic"``, ``"delayed"`` or a :class:`Float8Scaling` to copy.
        output_dtype: the dtype of ``y`` (float32, bfloat16 or float16, or a name such as
            ``'bf16'``), or ``None``.
        **scaling_options: the recipe's options (``history_len``, ``margin``, ...).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: Any = None, *, recipe: Any = "dynamic",
                 output_dtype: torch.dtype | None = None, **scaling_options: Any) -> None:  # fmt: skip
        if output_dtype is not None:
            output_dtype = as_dtype(output_dtype, "output_dtype")
        if output_dtype is not None and output_dtype not in OUTPUT_DTYPES:
            raise ValueError(
                f"output_dtype must be one of {', '.join(map(str, OUTPUT_DTYPES))} or None, "
                f"got {output_dtype!r}"
            )
        scalings = self._make_scalings(recipe, scaling_options, device)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.input_scaling, self.weight_scaling, self.grad_scaling = scalings
        self.output_dtype = output_dtype

    @staticmethod
    def _make_scalings(recipe: Any, options: dict[str, Any], device: Any) -> list[Float8Scaling]:
        dtypes = ("e4m3", "e4m3", "e5m2")
        return [make_scaling(recipe, d, **options).to(device) for d in dtypes]

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: Any = "dynamic",
                    output_dtype: torch.dtype | None = None, **scaling_options: Any) -> Float8Linear:  # fmt: skip
        """A ``Float8Linear`` that shares ``linear``'s Parameter objects and hooks.

        An optimizer built on ``linear``'s parameters keeps working on the new layer.

        >>> lin = nn.Linear(16, 16)
        >>> f8 = Float8Linear.from_linear(lin, recipe="delayed")
        >>> f8.weight is lin.weight, f8.bias is lin.bias
        (True, True)
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        device = linear.weight.device
        scalings = cls._make_scalings(recipe, scaling_options, device)
        # Built on the meta device: the placeholder parameters are replaced at once.
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device="meta", recipe=recipe, output_dtype=output_dtype, **scaling_options)  # fmt: skip
        new.weight = linear.weight
        new.bias = linear.bias
        new.input_scaling, new.weight_scaling, new.grad_scaling = scalings
        new.train(linear.training)
        for name in _HOOK_DICTS:
            if hasattr(linear, name):
                setattr(new, name, getattr(linear, name))
        return new

    @property
    def recipe(self) -> str:
        """The scaling recipe's name (``"dynamic"`` or ``"delayed"``)."""
        return self.input_scaling.kind

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.output_dtype is not None:
            return self.output_dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in OUTPUT_DTYPES:
            raise TypeError(
                f"Float8Linear takes float32, bfloat16 or float16 inputs, got {x.dtype}; "
                "cast the input (or keep this layer an nn.Linear)"
            )
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Float8Linear expects inputs of shape (..., {self.in_features}), "
                f"got {tuple(x.shape)}"
            )
        out_dtype = self._output_dtype(x)
        rows = x.reshape(-1, self.in_features)
        x8, x_inv = self.input_scaling.cast(rows)
        w8, w_inv = self.weight_scaling.cast(self.weight)
        y = _Float8Matmul.apply(rows, self.weight, x8, x_inv, w8, w_inv, self.grad_scaling,
                                out_dtype)  # fmt: skip
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, recipe={self.recipe!r}"
        return text if self.output_dtype is None else f"{text}, output_dtype={self.output_dtype}"
