"""Float8 all-gather of weights under FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter sharded and all-gathers it before the layer runs. A float8
layer casts its weight to float8 right after that, so the gather moves 4 (float32) or
2 (bfloat16) bytes per element that the layer then rounds to 1. With float8 all-gather
the weight is cast *before* the gather and the float8 bytes are what travel:

* :class:`Float8AllGatherWeight` is the sharded weight: a tensor subclass around the
  high-precision local shard (the optimizer updates it as usual) that implements
  FSDP2's extension hooks. ``fsdp_pre_all_gather`` takes the amax of the local shard,
  all-reduces it with MAX over the shard group (4 bytes: every rank then has the amax of
  the whole weight), casts the shard with the layer's ``weight_scaling`` and returns the
  float8 shard, with ``1 / scale`` as metadata (the scale is the same on every rank, so
  it is not gathered).
* ``fsdp_post_all_gather`` wraps the gathered float8 data in a
  :class:`Float8GatheredWeight`, which the float8 layer's forward uses as its float8
  weight instead of casting again.

The float8 values are those the layer computes without sharding: the max of the shards'
amaxes is the amax of the weight, and the cast is elementwise. Only the dynamic
tensorwise recipe can be cast before the gather: a delayed scale would need every
rank's amax history, and a scale per row is not one number for a shard.

Use :func:`enable_fsdp_float8_all_gather` (or ``convert_to_float8(...,
fsdp_float8_all_gather=True)``) on the converted model, then ``fully_shard`` it and
build the optimizer on the sharded parameters (as always with FSDP2).

>>> from mixprec.float8 import convert_to_float8
>>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
>>> _ = convert_to_float8(model, fsdp_float8_all_gather=True)
>>> type(model[0].weight).__name__, model[0].weight.dtype
('Float8AllGatherWeight', torch.float32)
>>> y = model(torch.randn(4, 32))  # unsharded, the weight computes as a plain tensor
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from mixprec.float8._scaling import Float8Scaling, tensor_amax

aten = torch.ops.aten

# Ops after which the sharded weight stays a Float8AllGatherWeight: the ones FSDP2 uses
# to shard, pad and move it (chunk, new_zeros, narrow, copy_, view, to), and the
# aliases nn.Parameter and DTensor take of it. Any other op computes on the plain shard.
_KEEP_WRAPPED = frozenset({
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor,
    aten.split_with_sizes.default, aten.empty_like.default, aten.new_zeros.default,
    aten.new_empty.default, aten.zeros_like.default, aten.clone.default, aten.copy_.default,
    aten._to_copy.default, aten._pin_memory.default,
})  # fmt: skip

# Ops that give a view of the gathered float8 weight: the layer reads it through
# these (Conv1D transposes it) and FSDP2 makes the unsharded parameter with them.
_GATHERED_VIEWS = frozenset({
    aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
    aten.t.default, aten.transpose.int, aten.permute.default,
})  # fmt: skip


def _float8_weight_scaling(module: nn.Module, name: str) -> Float8Scaling:
    """The ``weight_scaling`` of a float8 layer, checked to allow a cast before the gather."""
    scaling = getattr(module, "weight_scaling", None)
    if not isinstance(scaling, Float8Scaling):
        raise TypeError(
            f"{name} ({type(module).__name__}) is not a float8 layer: float8 all-gather "
            "needs a layer with a weight_scaling (convert the model with convert_to_float8)"
        )
    if scaling.kind != "dynamic":
        raise ValueError(
            f"float8 all-gather supports the dynamic tensorwise recipe only; layer {name!r} "
            f"uses recipe={scaling.kind!r}, whose weight scale is not one amax over the whole "
            "weight; convert with recipe='dynamic', or leave fsdp_float8_all_gather off"
        )
    return scaling


class Float8AllGatherWeight(torch.Tensor):
    """A float8 layer's high-precision weight that FSDP2 all-gathers in float8.

    It holds the weight (or, once ``fully_shard`` ran, this rank's shard) and behaves as
    that tensor for every op: the optimizer updates it in place, and the ops FSDP2
    shards and moves it with keep it wrapped. Its two hooks are what FSDP2 calls around
    the all-gather::

        fsdp_pre_all_gather:  amax = all_reduce(max(|shard|), MAX)    # 4 bytes
                              shard8, inv_scale = weight_scaling.cast(shard, amax)
                              return (shard8,), (inv_scale,)          # shard8 is gathered
        fsdp_post_all_gather: return Float8GatheredWeight(gathered8, inv_scale)

    The all-reduce syncs the ranks (not the host with the device). Made by
    :func:`enable_fsdp_float8_all_gather`.
    """

    _tensor: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> Float8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad,
        )  # fmt: skip

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's own subclasses do the same
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, outer_size: Any,
                             outer_stride: Any) -> Float8AllGatherWeight:  # fmt: skip
        return Float8AllGatherWeight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: Any,
                            module: nn.Module, mp_policy: Any
                            ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor]]:  # fmt: skip
        """Cast this rank's shard to float8 with the whole weight's scale (FSDP2 calls it).

        ``module`` is the float8 layer that owns the weight; its ``weight_scaling``
        records the scale and amax as an unsharded cast would. Returns the float8 shard
        (padded to FSDP2's shard size) and ``(1 / scale,)``.
        """
        scaling = _float8_weight_scaling(module, type(module).__name__)
        shard = self._tensor
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads the shards of dim 0 to this
        if shard.shape[0] < rows:  # a short last shard: zeros change neither amax nor data
            shard = nn.functional.pad(shard, (0, 0) * (shard.dim() - 1) + (0, rows - shard.shape[0]))
        shard = shard.detach()
        amax = self._precomputed_amax()
        if amax is None:
            amax = tensor_amax(shard)
            # The max of the shards' amaxes is the weight's amax: the scale, and so every
            # float8 value, is what the unsharded layer computes.
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        data, inv_scale = scaling._cast_with_amax(shard, amax)
        return (data,), (inv_scale,)

    def _precomputed_amax(self) -> torch.Tensor | None:
        """The whole weight's amax from :func:`precompute_float8_amax_for_fsdp`, if this
        shard has not changed since (same tensor, same version: an in-place update such
        as an optimizer step bumps the version); else ``None``."""
        kept = self.__dict__.get("_amax_of_version")
        if kept is None:
            return None
        amax, param, version, tensor = kept
        # The sharded parameter's version: an update reaches this shard through the
        # parameter's dispatch, below the autograd layer that counts versions, so only the
        # parameter's own counter moves.
        return amax if tensor is self._tensor and param._version == version else None

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> tuple[Float8GatheredWeight, tuple[torch.Tensor, ...]] | None:  # fmt: skip
        """Wrap the gathered float8 data as the unsharded weight (FSDP2 calls it).

        With ``out`` (FSDP2 reuses the unsharded weight from the first gather, whose data
        it gathered into again), only the scale is updated.
        """
        (data,), (inv_scale,) = all_gather_outputs, metadata
        if out is not None:
            if not isinstance(out, Float8GatheredWeight):
                raise TypeError(
                    f"out must be the Float8GatheredWeight of an earlier gather, got "
                    f"{type(out).__name__}"
                )
            out._inv_scale = inv_scale
            return None
        return Float8GatheredWeight(data, inv_scale, param_dtype), (data,)


class Float8GatheredWeight(torch.Tensor):
    """A weight in float8 with its inverse scale: what FSDP2 gathers for a float8 layer.

    Its dtype is the parameter's (the gradient's dtype); :meth:`float8_parts` gives the
    float8 data and ``1 / scale`` that a float8 layer multiplies with directly. Views
    (transpose, detach, as_strided) stay float8; other ops see the dequantized weight
    ``data * inv_scale`` (the values the float8 matmul uses); in-place ops are refused,
    as the data belongs to FSDP2's all-gather buffer.

    >>> w = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    >>> data, inv_scale = w.to(torch.float8_e4m3fn), torch.tensor(1.0)
    >>> g = Float8GatheredWeight(data, inv_scale, torch.float32)
    >>> g.t().float8_parts()[0].dtype, (g * 2).tolist()
    (torch.float8_e4m3fn, [[1.0, -4.0], [2.0, 0.5]])
    """

    _data: torch.Tensor
    _inv_scale: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, data: torch.Tensor, inv_scale: torch.Tensor,
                dtype: torch.dtype) -> Float8GatheredWeight:  # fmt: skip
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, layout=data.layout, device=data.device, requires_grad=False,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._inv_scale = data, inv_scale

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8GatheredWeight(data={self._data!r}, inv_scale={self._inv_scale!r})"

    def float8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, inv_scale)``: the float8 weight and ``1 / scale`` (``data * inv_scale``
        is the weight as float8 holds it)."""
        return self._data, self._inv_scale

    def dequantize(self) -> torch.Tensor:
        """The weight as the float8 matmul sees it, in this tensor's dtype."""
        return (self._data.float() * self._inv_scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's own subclasses do the same
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS:
            this = args[0]
            return cls(func(this._data, *args[1:], **kwargs), this._inv_scale, this.dtype)
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func} would write into a float8 weight gathered by FSDP2 (its data is the "
                "all-gather buffer); update the sharded parameters instead"
            )
        unwrap: Callable[[Float8GatheredWeight], torch.Tensor] = lambda t: t.dequantize()  # noqa: E731
        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_data", "_inv_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], dtype: torch.dtype, outer_size: Any,
                             outer_stride: Any) -> Float8GatheredWeight:  # fmt: skip
        return Float8GatheredWeight(inner["_data"], inner["_inv_scale"], dtype)


def check_float8_all_gather(model: nn.Module, recipe: Float8Scaling | None = None
                            ) -> list[tuple[str, nn.Module]]:  # fmt: skip
    """The float8 layers of ``model``, checked to allow float8 all-gather (and ``recipe``,
    the scaling of layers about to be converted); raises before anything changes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if recipe is not None and recipe.kind != "dynamic":
        raise ValueError(
            f"fsdp_float8_all_gather=True supports the dynamic tensorwise recipe only, got "
            f"recipe={recipe.kind!r}: its weight scale is not one amax over the whole "
            "weight; pass recipe='dynamic', or leave fsdp_float8_all_gather off"
        )
    from torch.distributed.tensor import DTensor  # loaded where used: only FSDP needs it

    sharded = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"parameter {sharded[0]!r} is a DTensor: the model is sharded already; enable "
            "float8 all-gather (enable_fsdp_float8_all_gather, or convert_to_float8(..., "
            "fsdp_float8_all_gather=True)) before fully_shard"
        )
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(getattr(m, "weight_scaling", None), Float8Scaling)]  # fmt: skip
    for name, module in layers:
        _float8_weight_scaling(module, name)
    return layers


def enable_fsdp_float8_all_gather(model: nn.Module) -> list[str]:
    """Make FSDP2 all-gather the weights of ``model``'s float8 layers in float8; return their names.

    Call it on a converted model before ``fully_shard``; each float8 layer's weight
    becomes a :class:`Float8AllGatherWeight` Parameter (same storage, new Parameter
    object: build the optimizer after ``fully_shard``, which replaces the parameters
    anyway). Layers already enabled are listed again and left as they are. Without
    FSDP2 the weights compute as plain tensors. Refused (``ValueError``, nothing
    changed) for a layer whose recipe is not ``"dynamic"`` and for a model already
    sharded.

    >>> from mixprec.float8 import convert_to_float8
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    >>> _ = convert_to_float8(model, "delayed")
    >>> enable_fsdp_float8_all_gather(model)
    Traceback (most recent call last):
    ...
    ValueError: float8 all-gather supports the dynamic tensorwise recipe only; layer '0' uses recipe='delayed', whose weight scale is not one amax over the whole weight; convert with recipe='dynamic', or leave fsdp_float8_all_gather off
    """
    layers = check_float8_all_gather(model)
    wrapped: dict[int, nn.Parameter] = {}
    for _, module in layers:
        weight = cast(nn.Parameter, module.weight)
        if isinstance(weight, Float8AllGatherWeight) or id(weight) in wrapped:
            continue
        wrapped[id(weight)] = nn.Parameter(Float8AllGatherWeight(weight.detach()),
                                           requires_grad=weight.requires_grad)  # fmt: skip
    # Every module holding a wrapped weight gets the new Parameter: tied weights stay tied.
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in wrapped:
                module._parameters[key] = wrapped[id(param)]
    return [name for name, _ in layers]


def precompute_float8_amax_for_fsdp(model: nn.Module) -> int:
    """All-reduce the amax of every float8-gathered weight of ``model`` at once; return
    how many there are.

    Each float8 all-gather otherwise all-reduces its own weight's amax (one small
    collective, a rank sync, per weight and gather). Called after ``optimizer.step()``,
    this takes every local shard's amax in one op and all-reduces them in one
    collective per mesh; each gather then uses its weight's amax, for the forward's and
    the backward's gather alike, while the shard stays as it was. A shard changed
    since (its version counter moved: the next optimizer step) makes its gather
    all-reduce again, so a missed call costs a collective, never a stale scale. The
    float8 values are the same either way. ``model`` is converted with
    ``fsdp_float8_all_gather=True`` and sharded by ``fully_shard`` on one-dimensional
    meshes; anything else is refused (``ValueError``) before any collective.

    The same role as torchao's ``precompute_float8_dynamic_scale_for_fsdp``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    from torch.distributed.tensor import DTensor  # loaded where used: only FSDP needs it

    groups: dict[Any, list[Any]] = {}  # group -> its sharded DTensor parameters
    for name, param in model.named_parameters():
        if not (isinstance(param, DTensor)
                and isinstance(param._local_tensor, Float8AllGatherWeight)):  # fmt: skip
            continue
        if param.device_mesh.ndim != 1:
            raise ValueError(
                f"parameter {name!r} is sharded over a {param.device_mesh.ndim}-D mesh; "
                "precompute_float8_amax_for_fsdp takes one-dimensional meshes only: leave "
                "the amax to each gather there"
            )
        groups.setdefault(param.device_mesh.get_group(), []).append(param)
    if not groups:
        raise ValueError(
            "model has no FSDP2-sharded float8 all-gather weight: convert it with "
            "convert_to_float8(..., fsdp_float8_all_gather=True), shard it with fully_shard, "
            "then call this after each optimizer step"
        )
    for group, params in groups.items():
        weights = [param._local_tensor for param in params]
        amaxes = torch.stack([tensor_amax(weight._tensor.detach()) for weight in weights])
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        for param, weight, amax in zip(params, weights, amaxes.unbind()):
            weight._amax_of_version = (amax, param, param._version, weight._tensor)
    return sum(len(params) for params in groups.values())
