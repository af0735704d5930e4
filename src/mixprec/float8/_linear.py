"""Float8 layers: ``Float8Linear`` (an ``nn.Linear``) and ``Float8Conv1D`` (Hugging Face's
``Conv1D``, the projection of GPT-2, whose weight is stored transposed as ``(in, out)``),
whose three matmuls run in float8 with per-tensor scales.

Forward ``y = x @ W^T (+ b)``: ``x`` and ``W`` are cast to float8_e4m3fn, each with
its own scale, and multiplied by ``torch._scaled_mm``, which undoes both scales and
writes ``y`` in high precision. Backward: the output gradient is cast to
float8_e5m2 (two more exponent bits: gradients span a wider range) with a third
scale, then ``grad_x = grad_y @ W`` and ``grad_W = grad_y^T @ x`` are two more
scaled matmuls against the float8 copies saved by the forward. The bias is added,
and its gradient computed, in high precision. On a device without a float8 matmul
the same products are emulated in float32 (:mod:`mixprec.float8._matmul`).
``Float8Conv1D`` casts the same weight through a transposed view: same scales, same
float8 values, same matmuls as a ``Float8Linear`` holding ``W^T``.

A float8 layer is made from a plain one (``from_linear``, ``from_conv1d``) by taking
over its state: the same Parameter objects, buffers, hooks and attributes, plus the
three scalings; :meth:`Float8Layer.to_plain` gives the plain layer back (same
Parameters, the scalings dropped), whose ``state_dict`` is the original's.

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

import abc
from typing import Any, cast

import torch
from torch import nn

from mixprec._checks import as_dtype
from mixprec.float8._fsdp import Float8GatheredWeight
from mixprec.float8._matmul import scaled_mm
from mixprec.float8._rowwise import RowwiseScaling, rowwise_matmul
from mixprec.float8._scaling import Float8Scaling, make_scaling

#: Output dtypes ``torch._scaled_mm`` can write.
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``torch._scaled_mm`` on GPUs needs every contracted and output dimension to be a
#: multiple of this; the token dimension, contracted in ``grad_W``, is padded to it.
ALIGNMENT = 16
#: The scaling submodules of a float8 layer, one per cast tensor.
SCALING_NAMES = ("input_scaling", "weight_scaling", "grad_scaling")
# Attributes only a float8 layer has, dropped when it becomes plain again.
_FLOAT8_ATTRIBUTES = frozenset({"output_dtype", "source_class"})
# Per-instance state that must not follow the layer into its float8 form: a compiled
# call of the plain layer would run its plain forward.
_NOT_TAKEN_OVER = frozenset({"_compiled_call_impl"})


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of :data:`ALIGNMENT` (zeros add nothing)."""
    missing = -t.shape[0] % ALIGNMENT
    return torch.nn.functional.pad(t, (0, 0, 0, missing)) if missing else t


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """``t^T`` written row-major with its columns padded to :data:`ALIGNMENT`: the layout of
    a backward operand (``t^T`` on the left, or ``t`` column-major on the right)."""
    return _pad_rows(t).t().contiguous()


class _Float8Matmul(torch.autograd.Function):
    """``x @ W^T`` from float8 copies; the backward casts ``grad_y`` to e5m2 and runs
    both gradient matmuls in float8. ``x`` and ``weight`` are inputs only so that their
    gradients are routed to them; the float8 copies are what is used and saved.

    Each operand is written once in every layout a matmul takes it in, by the pass that
    casts it: the forward saves ``W8^T`` and ``x8^T`` (row-major, rows padded) for the
    backward, and the backward writes ``g8`` and ``g8^T`` from one cast. Under
    ``torch.compile`` a transpose then costs no pass of its own: it is one more store
    of the cast's loop. ``_scaled_mm``'s second operand is column-major: ``B^T``
    row-major, read through ``.t()``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, x8: torch.Tensor,
                x_inv: torch.Tensor, w8: torch.Tensor, w_inv: torch.Tensor,
                grad_scaling: Float8Scaling, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        # ``weight`` and ``w8`` are (out, in), possibly as transposed views (Conv1D, whose
        # storage is (in, out)). The forward reads W column-major (W^T row-major) and
        # the backward W row-major: for nn.Linear the second is the cast itself and the
        # first one copy. So is it for Conv1D under torch.compile, where both are stores
        # of the cast's loop; eagerly its cast is the first and the second one copy. Both
        # layer kinds run the same matmuls.
        if w8.is_contiguous() or torch.compiler.is_compiling():
            w8t = w8.contiguous().t()
            w_for_y = w8t
        else:
            w8t = w8.t()
            w_for_y = w8.contiguous().t()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(w8t.contiguous() if need_x else None, w_inv,
                              _transposed(x8) if need_w else None, x_inv)  # fmt: skip
        ctx.grad_scaling = grad_scaling
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return scaled_mm(x8, w_for_y, x_inv, w_inv, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w8t, w_inv, x8t, x_inv = ctx.saved_tensors
        g8, g_inv = ctx.grad_scaling._cast(grad_y)
        g8 = g8.contiguous()
        grad_x = grad_w = None
        if w8t is not None:  # grad_x = g @ W: W (out, in) column-major is W^T row-major
            grad_x = scaled_mm(g8, w8t.t(), g_inv, w_inv, ctx.x_dtype)
        if x8t is not None:  # grad_W = g^T @ x, the token dimension padded
            grad_w = scaled_mm(_transposed(g8), x8t.t(), g_inv, x_inv, ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def _check_output_dtype(output_dtype: Any) -> torch.dtype | None:
    if output_dtype is None:
        return None
    output_dtype = as_dtype(output_dtype, "output_dtype")
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(
            f"output_dtype must be one of {', '.join(map(str, OUTPUT_DTYPES))} or None, "
            f"got {output_dtype!r}"
        )
    return output_dtype


def _make_scalings(recipe: Any, options: dict[str, Any], device: Any) -> list[Float8Scaling]:
    scalings = [make_scaling(recipe, "e4m3", **options) for _ in range(2)]
    # The rowwise recipes cast the gradient to e4m3 too (torchao's choice): a scale per
    # row fits each row's range, so e5m2's wider exponent is not needed there.
    grad_dtype = "e4m3" if isinstance(scalings[0], RowwiseScaling) else "e5m2"
    scalings.append(make_scaling(recipe, grad_dtype, **options))
    return [scaling.to(device) for scaling in scalings]


def conv1d_class() -> type[nn.Module] | None:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D``, or ``None`` without transformers.

    >>> conv1d_class() is None or conv1d_class().__name__ == "Conv1D"
    True
    """
    try:
        from transformers.pytorch_utils import Conv1D  # optional: loaded where used
    except ImportError:
        return None
    return Conv1D


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (or a subclass), without importing it.

    >>> is_conv1d(nn.Linear(2, 2))
    False
    """
    return any(
        cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"
        for cls in type(module).__mro__
    )


class Float8Layer(nn.Module, abc.ABC):
    """What every float8 layer has: three scalings, an output dtype, the float8 forward.

    Subclasses say how to read their weight as ``(out, in)`` (:meth:`weight_out_in`),
    their sizes, and which plain class they came from (``source_class``).
    """

    input_scaling: Float8Scaling
    weight_scaling: Float8Scaling
    grad_scaling: Float8Scaling
    output_dtype: torch.dtype | None
    source_class: type[nn.Module] | None
    weight: torch.Tensor

    def _setup(self, recipe: Any, output_dtype: Any, options: dict[str, Any],
               device: Any) -> None:  # fmt: skip
        self.input_scaling, self.weight_scaling, self.grad_scaling = _make_scalings(
            recipe, options, device
        )
        self.output_dtype = output_dtype

    @classmethod
    def _take_over(cls, module: nn.Module, recipe: Any, output_dtype: Any,
                   options: dict[str, Any]) -> Any:  # fmt: skip
        """A float8 layer holding ``module``'s state (see the module docstring)."""
        output_dtype = _check_output_dtype(output_dtype)
        scalings = _make_scalings(recipe, options, module.weight.device)  # validates first
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key, value in vars(module).items():
            if key in _NOT_TAKEN_OVER:
                continue
            if key in ("_parameters", "_buffers", "_modules"):
                value = dict(value)  # the same objects in the new layer's own registry
            elif key == "_non_persistent_buffers_set":
                value = set(value)
            new.__dict__[key] = value  # hook dicts are shared: no hook is lost
        for scaling in scalings:
            scaling.train(module.training)
        new.input_scaling, new.weight_scaling, new.grad_scaling = scalings
        new.output_dtype = output_dtype
        new.source_class = type(module)
        return new

    def to_plain(self) -> nn.Module:
        """The plain layer this one stands for: same Parameters, buffers, hooks and
        attributes, without the scalings (its ``state_dict`` has no float8 entries).

        >>> layer = Float8Linear.from_linear(nn.Linear(16, 32))
        >>> plain = layer.to_plain()
        >>> type(plain).__name__, plain.weight is layer.weight, sorted(plain.state_dict())
        ('Linear', True, ['bias', 'weight'])
        """
        cls = self.source_class
        if cls is None:
            raise ValueError(
                f"this {type(self).__name__} has no plain class to return to (transformers "
                "is not installed, so Conv1D is unknown): install transformers, or build the "
                "plain layer yourself from .weight and .bias"
            )
        plain = cls.__new__(cls)
        nn.Module.__init__(plain)
        for key, value in vars(self).items():
            if key in _FLOAT8_ATTRIBUTES or key in _NOT_TAKEN_OVER:
                continue
            if key == "_modules":
                value = {k: m for k, m in value.items() if k not in SCALING_NAMES}
            elif key in ("_parameters", "_buffers"):
                value = dict(value)
            elif key == "_non_persistent_buffers_set":
                value = set(value)
            plain.__dict__[key] = value
        return plain

    @property
    def recipe(self) -> str:
        """The scaling recipe's name (``"dynamic"``, ``"delayed"``, ``"rowwise"``, ...)."""
        return self.input_scaling.kind

    @abc.abstractmethod
    def weight_out_in(self) -> torch.Tensor:
        """The weight as an ``(out, in)`` matrix (a view for transposed storage)."""

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.output_dtype is not None:
            return self.output_dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def _float8_forward(self, x: torch.Tensor, in_features: int, out_features: int
                        ) -> torch.Tensor:  # fmt: skip
        if x.dtype not in OUTPUT_DTYPES:
            raise TypeError(
                f"{type(self).__name__} takes float32, bfloat16 or float16 inputs, got "
                f"{x.dtype}; cast the input (or keep this layer in high precision)"
            )
        if x.dim() == 0 or x.shape[-1] != in_features:
            raise ValueError(
                f"{type(self).__name__} expects inputs of shape (..., {in_features}), "
                f"got {tuple(x.shape)}"
            )
        out_dtype = self._output_dtype(x)
        rows = x.reshape(-1, in_features)
        weight = self.weight_out_in()
        if isinstance(self.input_scaling, RowwiseScaling):  # a scale per row: _rowwise.py
            y = rowwise_matmul(rows, weight, self.input_scaling, self.weight_scaling,
                               self.grad_scaling, out_dtype)  # fmt: skip
        else:
            with torch.no_grad():  # the casts are not differentiated (no detach op needed)
                x8, x_inv = self.input_scaling._cast(rows)
                if isinstance(weight, Float8GatheredWeight):  # FSDP2 gathered it in float8
                    w8, w_inv = weight.float8_parts()
                else:
                    w8, w_inv = self.weight_scaling._cast(weight)
            y = _Float8Matmul.apply(rows, weight, x8, x_inv, w8, w_inv, self.grad_scaling,
                                    out_dtype)  # fmt: skip
        y = y.reshape(*x.shape[:-1], out_features)
        bias = cast("torch.Tensor | None", self.bias)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y

    def _float8_repr(self) -> str:
        text = f"recipe={self.recipe!r}"
        return text if self.output_dtype is None else f"{text}, output_dtype={self.output_dtype}"


class Float8Linear(Float8Layer, nn.Linear):
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
    on, else in the input's dtype. No host sync anywhere. ``source_class`` is the
    plain class it stands for (``nn.Linear``, or the subclass it was made from), which
    :meth:`to_plain` returns to.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: ``"dynamic"``, ``"delayed"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``
            (:mod:`~mixprec.float8._rowwise`) or a :class:`Float8Scaling` to copy.
        output_dtype: the dtype of ``y`` (float32, bfloat16 or float16, or a name such as
            ``'bf16'``), or ``None``.
        **scaling_options: the recipe's options (``history_len``, ``margin``, ...).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: Any = None, *, recipe: Any = "dynamic",
                 output_dtype: torch.dtype | None = None, **scaling_options: Any) -> None:  # fmt: skip
        output_dtype = _check_output_dtype(output_dtype)
        _make_scalings(recipe, scaling_options, "meta")  # validates before anything is built
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe, output_dtype, scaling_options, device)
        self.source_class = nn.Linear

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: Any = "dynamic",
                    output_dtype: torch.dtype | None = None, **scaling_options: Any) -> Float8Linear:  # fmt: skip
        """A ``Float8Linear`` that takes over ``linear``'s Parameter objects, hooks and state.

        ``linear`` may be a subclass of ``nn.Linear`` that keeps ``nn.Linear.forward``
        (its extra attributes, buffers and submodules come along, and :meth:`to_plain`
        returns to its class). An optimizer built on ``linear``'s parameters keeps
        working on the new layer.

        >>> lin = nn.Linear(16, 16)
        >>> f8 = Float8Linear.from_linear(lin, recipe="delayed")
        >>> f8.weight is lin.weight, f8.bias is lin.bias, f8.source_class.__name__
        (True, True, 'Linear')
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear, Float8Layer):
            raise TypeError("linear is a float8 layer already; pass its .to_plain()")
        return cls._take_over(linear, recipe, output_dtype, scaling_options)

    def weight_out_in(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._float8_forward(x, self.in_features, self.out_features)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self._float8_repr()}"


class Float8Conv1D(Float8Layer):
    """Hugging Face's ``Conv1D`` (``y = x @ W + b`` with ``W`` stored as ``(in, out)``) in float8.

    The weight is cast through its transposed view, so the scales, the float8 values
    and the three matmuls are exactly those of a :class:`Float8Linear` holding
    ``W^T``; the gradient reaches ``W`` in its own ``(in, out)`` layout. Attributes
    ``nf`` (out) and ``nx`` (in) as ``Conv1D``. Made by :meth:`from_conv1d` (or
    :func:`mixprec.float8.convert_to_float8`); :meth:`to_plain` returns the ``Conv1D``.

    Args:
        nf, nx: output and input features, as ``Conv1D(nf, nx)``.
        device, dtype: of the new weight and bias.
        recipe, output_dtype, **scaling_options: as :class:`Float8Linear`.

    >>> layer = Float8Conv1D(32, 16, recipe="delayed")
    >>> layer.weight.shape, layer(torch.randn(2, 3, 16)).shape
    (torch.Size([16, 32]), torch.Size([2, 3, 32]))
    """

    def __init__(self, nf: int, nx: int, device: Any = None, dtype: Any = None, *,
                 recipe: Any = "dynamic", output_dtype: torch.dtype | None = None,
                 **scaling_options: Any) -> None:  # fmt: skip
        output_dtype = _check_output_dtype(output_dtype)
        _make_scalings(recipe, scaling_options, "meta")
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)  # Conv1D's own initialisation
        self._setup(recipe, output_dtype, scaling_options, device)
        self.source_class = conv1d_class()

    @classmethod
    def from_conv1d(cls, conv: nn.Module, *, recipe: Any = "dynamic",
                    output_dtype: torch.dtype | None = None, **scaling_options: Any) -> Float8Conv1D:  # fmt: skip
        """A ``Float8Conv1D`` that takes over ``conv``'s Parameter objects, hooks and state.

        >>> from transformers.pytorch_utils import Conv1D
        >>> conv = Conv1D(32, 16)
        >>> f8 = Float8Conv1D.from_conv1d(conv)
        >>> f8.weight is conv.weight, type(f8.to_plain()).__name__
        (True, 'Conv1D')
        """
        if not is_conv1d(conv):
            raise TypeError(
                f"conv must be a transformers Conv1D, got {type(conv).__name__}; use "
                "Float8Linear.from_linear for nn.Linear layers"
            )
        if isinstance(conv, Float8Layer):
            raise TypeError("conv is a float8 layer already; pass its .to_plain()")
        return cls._take_over(conv, recipe, output_dtype, scaling_options)

    def weight_out_in(self) -> torch.Tensor:
        return self.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._float8_forward(x, self.nx, self.nf)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, {self._float8_repr()}"
