"""``convert_to_float8`` and ``convert_from_float8``: a model's matmul layers into float8 and back.

Every module that holds a matmul is considered and reported: ``nn.Linear`` (and its
subclasses) and Hugging Face's ``Conv1D`` (GPT-2's projections) are converted when the
filter accepts them and ``torch._scaled_mm`` can run them (in and out features
multiples of 16); convolutions, recurrent layers, ``nn.Bilinear`` and the input
projection of ``nn.MultiheadAttention`` have no float8 form and are listed with that
reason. The swap is in place and keeps the same Parameter objects, so an optimizer
built before the conversion keeps working. The returned :class:`Float8Report` says,
for each matmul layer, whether it runs in float8 and, if not, why.

``convert_from_float8`` swaps every float8 layer back for the plain layer it stands
for (same Parameters), whose ``state_dict`` loads with ``strict=True`` into the
original architecture: the way to deploy a model trained in float8.

>>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
>>> report = convert_to_float8(model, "delayed")
>>> report.converted, type(model[0]).__name__
(['0'], 'Float8Linear')
>>> print(report)
float8 (recipe 'delayed'): 1 of 2 matmul layers converted
layer  kind    in  out  float8  reason
0      Linear  32  64   yes
2      Linear  64  10   no      out_features=10 is not a multiple of 16
>>> plain = convert_from_float8(model)
>>> type(plain[0]).__name__, sorted(plain.state_dict()) == sorted(nn.Sequential(
...     nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).state_dict())
('Linear', True)
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from mixprec._checks import check_bool, check_instance
from mixprec.float8._fsdp import check_float8_all_gather, enable_fsdp_float8_all_gather
from mixprec.float8._linear import (
    ALIGNMENT,
    Float8Conv1D,
    Float8Layer,
    Float8Linear,
    is_conv1d,
)
from mixprec.float8._scaling import make_scaling

ModuleFilter = str | Sequence[str] | Callable[[str, nn.Module], bool] | None


@dataclasses.dataclass(frozen=True)
class Float8Decision:
    """What :func:`convert_to_float8` did with one matmul layer (``kind``: its class name)."""

    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str = ""
    kind: str = "Linear"


@dataclasses.dataclass(frozen=True)
class Float8Report:
    """The matmul layers of a model and whether each runs in float8 (``str()``: a table)."""

    recipe: str
    decisions: tuple[Float8Decision, ...]

    @property
    def converted(self) -> list[str]:
        """Names of the layers that now run in float8."""
        return [d.name for d in self.decisions if d.converted]

    @property
    def skipped(self) -> dict[str, str]:
        """Names of the matmul layers left as they were, with the reason."""
        return {d.name: d.reason for d in self.decisions if not d.converted}

    def __str__(self) -> str:
        head = (f"float8 (recipe {self.recipe!r}): {len(self.converted)} of "
                f"{len(self.decisions)} matmul layers converted")  # fmt: skip
        rows = [("layer", "kind", "in", "out", "float8", "reason")] + [
            (d.name or "(model)", d.kind, str(d.in_features), str(d.out_features),
             "yes" if d.converted else "no", d.reason)
            for d in self.decisions
        ]  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[5]]).rstrip()
                 for row in rows]  # fmt: skip
        return "\n".join([head, *lines])


def _as_predicate(module_filter: ModuleFilter) -> Callable[[str, nn.Module], bool]:
    if module_filter is None:
        return lambda name, module: True
    if isinstance(module_filter, str):
        module_filter = [module_filter]
    if callable(module_filter):
        return module_filter
    if isinstance(module_filter, Sequence) and all(isinstance(p, str) for p in module_filter):
        patterns = list(module_filter)
        return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)
    raise TypeError(
        "module_filter must be None, an fnmatch pattern such as 'encoder.*', a list of "
        f"patterns, or a callable (name, module) -> bool; got {type(module_filter).__name__} "
        f"{module_filter!r}"
    )


_NO_FLOAT8 = "not supported: float8 covers nn.Linear and Conv1D layers"
# Matmul-bearing modules without a float8 form: (class, in attribute, out attribute, why).
_UNSUPPORTED: tuple[tuple[type[nn.Module], str, str, str], ...] = (
    (nn.Bilinear, "in1_features", "out_features", f"{_NO_FLOAT8}, not bilinear forms"),
    (nn.modules.conv._ConvNd, "in_channels", "out_channels", f"{_NO_FLOAT8}, not convolutions"),
    (nn.RNNBase, "input_size", "hidden_size",
     f"{_NO_FLOAT8}; a recurrent layer runs its matmuls inside one fused kernel"),
    (nn.RNNCellBase, "input_size", "hidden_size",
     f"{_NO_FLOAT8}; a recurrent cell runs its matmuls inside one fused kernel"),
)  # fmt: skip


def _matmul_layer(module: nn.Module) -> tuple[str, int, int] | None:
    """``(kind, in, out)`` of a module that computes a matmul with its own weight."""
    kind = type(module).__name__
    if isinstance(module, Float8Conv1D) or is_conv1d(module):
        return kind, int(getattr(module, "nx")), int(getattr(module, "nf"))  # noqa: B009
    if isinstance(module, nn.Linear):
        return kind, module.in_features, module.out_features
    if isinstance(module, nn.MultiheadAttention):
        return kind, module.embed_dim, module.embed_dim
    for cls, size_in, size_out, _ in _UNSUPPORTED:
        if isinstance(module, cls):
            return kind, getattr(module, size_in), getattr(module, size_out)
    return None


def _plain_forward(module: nn.Module) -> type[nn.Module]:
    """The class whose forward a convertible layer must keep: nn.Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return nn.Linear
    return next(
        c for c in type(module).__mro__
        if c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils"
    )  # fmt: skip


def _why_not(name: str, module: nn.Module, parent: nn.Module | None) -> str:
    """Why ``module`` cannot run in float8 (``""``: it can)."""
    if isinstance(module, Float8Layer):
        return f"already a {type(module).__name__}"
    if isinstance(module, nn.MultiheadAttention):
        return (f"{_NO_FLOAT8}; nn.MultiheadAttention passes its input-projection weight to "
                "the attention function itself")  # fmt: skip
    for cls, _, _, why in _UNSUPPORTED:
        if isinstance(module, cls):
            return why
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this projection's weight directly, not its forward"
    if parametrize.is_parametrized(module):
        return "its weight is parametrized (the parametrization would be bypassed)"
    if isinstance(module.weight, nn.parameter.UninitializedParameter):
        return "its weight is not initialized yet (a lazy layer): run one forward first"
    base = _plain_forward(module)
    if "forward" in vars(module):
        return "its forward is replaced on the instance, so a float8 forward would bypass it"
    if type(module).forward is not base.forward:
        return (f"{type(module).__name__} overrides {base.__name__}.forward, which may compute "
                "more than the matmul and bias a float8 layer computes")  # fmt: skip
    if parent is None:
        maker = "Float8Linear.from_linear" if base is nn.Linear else "Float8Conv1D.from_conv1d"
        return f"the model itself is the layer; use {maker}(model)"
    sizes = ("in_features", "out_features") if base is nn.Linear else ("nx", "nf")
    for what in sizes:
        size = getattr(module, what)
        if size % ALIGNMENT:
            return f"{what}={size} is not a multiple of {ALIGNMENT}"
    return ""


def convert_to_float8(
    model: nn.Module,
    recipe: Any = "dynamic",
    *,
    module_filter: ModuleFilter = None,
    output_dtype: Any = None,
    fsdp_float8_all_gather: bool = False,
    **scaling_options: Any,
) -> Float8Report:
    """Swap ``model``'s eligible matmul layers for float8 layers, in place.

    ``nn.Linear`` layers (and subclasses that keep ``nn.Linear.forward``) become
    :class:`Float8Linear`, Hugging Face ``Conv1D`` layers :class:`Float8Conv1D`.

    Args:
        model: the model; changed in place, and only if every argument is valid.
        recipe: ``"dynamic"``, ``"delayed"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``
            (:class:`~mixprec.float8.RowwiseScaling`) or a :class:`Float8Scaling` to copy.
        module_filter: which layers to convert, by qualified name: an fnmatch pattern,
            a list of patterns, or a callable ``(name, module) -> bool``; ``None``: all.
        output_dtype: forwarded to the float8 layers.
        fsdp_float8_all_gather: make FSDP2 all-gather the float8 layers' weights in
            float8 (:func:`enable_fsdp_float8_all_gather`; ``recipe="dynamic"`` only).
        **scaling_options: the recipe's options: ``history_len`` (16) and
            ``amax_compute_algo`` (``"max"``) for delayed, ``eps`` for dynamic and
            the rowwise recipes, ``margin`` and ``power_of_2`` for all (the rowwise
            recipes round scales to powers of two unless ``power_of_2=False``).

    Returns:
        A :class:`Float8Report` naming each matmul layer and why it was not converted.
    """
    check_instance("model", model, nn.Module, "an nn.Module",
                   hint="pass the model whose Linear layers should run in float8")  # fmt: skip
    # Validates recipe and options before anything changes.
    template = make_scaling(recipe, "e4m3", **scaling_options)
    Float8Linear(ALIGNMENT, ALIGNMENT, device="meta", recipe=recipe, output_dtype=output_dtype,
                 **scaling_options)  # fmt: skip
    accept = _as_predicate(module_filter)
    if check_bool("fsdp_float8_all_gather", fsdp_float8_all_gather):
        check_float8_all_gather(model, template)

    parents: dict[int, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    decisions: list[Float8Decision] = []
    swaps: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        layer = _matmul_layer(module)
        if layer is None:
            continue
        kind, size_in, size_out = layer
        reason = _why_not(name, module, parents.get(id(module)))
        if not reason and not accept(name, module):
            reason = "excluded by module_filter"
        decisions.append(Float8Decision(name, size_in, size_out, not reason, reason, kind))
        if reason:
            continue
        options = dict(recipe=recipe, output_dtype=output_dtype, **scaling_options)
        if isinstance(module, nn.Linear):
            swaps[id(module)] = Float8Linear.from_linear(module, **options)
        else:
            swaps[id(module)] = Float8Conv1D.from_conv1d(module, **options)
    _swap(model, swaps)
    if fsdp_float8_all_gather:
        enable_fsdp_float8_all_gather(model)
    return Float8Report(template.kind, tuple(decisions))


def _swap(model: nn.Module, swaps: dict[int, nn.Module]) -> None:
    # Every reference is replaced, so a layer shared by two parents stays shared.
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in swaps:
                setattr(parent, child_name, swaps[id(child)])


def convert_from_float8(model: nn.Module) -> nn.Module:
    """Swap every float8 layer of ``model`` back for its plain layer, in place; return ``model``.

    Each :class:`Float8Linear` becomes the ``nn.Linear`` (or subclass) it was made from,
    each :class:`Float8Conv1D` a ``Conv1D``, with the same Parameter objects, buffers
    and hooks; the float8 scaling state is dropped. The model's ``state_dict`` then
    loads with ``strict=True`` into the original architecture, and an optimizer built
    on its parameters keeps working. ``model`` itself being a float8 layer, its plain
    layer is returned. To keep training in float8 and still save a plain checkpoint,
    convert a copy: ``convert_from_float8(copy.deepcopy(model)).state_dict()``.

    >>> model = nn.Sequential(nn.Linear(16, 16))
    >>> _ = convert_to_float8(model)
    >>> sorted(model.state_dict())[:3]
    ['0.bias', '0.grad_scaling.amax', '0.grad_scaling.numel']
    >>> sorted(convert_from_float8(model).state_dict())
    ['0.bias', '0.weight']
    """
    check_instance("model", model, nn.Module, "an nn.Module",
                   hint="pass the model convert_to_float8 converted")  # fmt: skip
    if isinstance(model, Float8Layer):
        return model.to_plain()
    # Every plain layer is built before any is swapped in: a failure changes nothing.
    swaps = {id(m): m.to_plain() for m in model.modules() if isinstance(m, Float8Layer)}
    _swap(model, swaps)
    return model
