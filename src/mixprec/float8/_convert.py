"""``convert_to_float8``: swap a model's eligible ``nn.Linear`` layers for :class:`Float8Linear`.

Every ``nn.Linear`` is considered; one is converted when the filter accepts it and
``torch._scaled_mm`` can run it (in and out features multiples of 16). The swap is
in place and keeps the same Parameter objects, so an optimizer built before the
conversion keeps working. The returned :class:`Float8Report` says, for each linear
layer, whether it runs in float8 and, if not, why.

>>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
>>> report = convert_to_float8(model, "delayed")
>>> report.converted, type(model[0]).__name__
(['0'], 'Float8Linear')
>>> print(report)
float8 (recipe 'delayed'): 1 of 2 linear layers converted
layer  in  out  float8  reason
0      32  64   yes
2      64  10   no      out_features=10 is not a multiple of 16
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from mixprec._checks import check_instance
from mixprec.float8._linear import ALIGNMENT, Float8Linear
from mixprec.float8._scaling import make_scaling

__all__ = ["Float8Decision", "Float8Report", "convert_to_float8"]

ModuleFilter = str | Sequence[str] | Callable[[str, nn.Module], bool] | None


@dataclasses.dataclass(frozen=True)
class Float8Decision:
    """What :func:`convert_to_float8` did with one linear layer."""

    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Float8Report:
    """The linear layers of a model and whether each runs in float8 (``str()``: a table)."""

    recipe: str
    decisions: tuple[Float8Decision, ...]

    @property
    def converted(self) -> list[str]:
        """Names of the layers that now run in float8."""
        return [d.name for d in self.decisions if d.converted]

    @property
    def skipped(self) -> dict[str, str]:
        """Names of the linear layers left as they were, with the reason."""
        return {d.name: d.reason for d in self.decisions if not d.converted}

    def __str__(self) -> str:
        head = (f"float8 (recipe {self.recipe!r}): {len(self.converted)} of "
                f"{len(self.decisions)} linear layers converted")  # fmt: skip
        rows = [("layer", "in", "out", "float8", "reason")] + [
            (d.name or "(model)", str(d.in_features), str(d.out_features),
             "yes" if d.converted else "no", d.reason)
            for d in self.decisions
        ]  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[4]]).rstrip()
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


def _why_not(name: str, module: nn.Linear, parent: nn.Module | None) -> str:
    """Why ``module`` cannot run in float8 (``""``: it can)."""
    if isinstance(module, Float8Linear):
        return "already a Float8Linear"
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this projection's weight directly, not its forward"
    if parametrize.is_parametrized(module):
        return "its weight is parametrized (the parametrization would be bypassed)"
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} subclasses nn.Linear and may change its forward"
    if parent is None:
        return "the model itself is the layer; use Float8Linear.from_linear(model)"
    for what in ("in_features", "out_features"):
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
    **scaling_options: Any,
) -> Float8Report:
    """Swap ``model``'s eligible ``nn.Linear`` layers for :class:`Float8Linear`, in place.

    Args:
        model: the model; changed in place, and only if every argument is valid.
        recipe: ``"dynamic"``, ``"delayed"`` or a :class:`Float8Scaling` to copy.
        module_filter: which layers to convert, by qualified name: an fnmatch pattern,
            a list of patterns, or a callable ``(name, module) -> bool``; ``None``: all.
        output_dtype: forwarded to :class:`Float8Linear`.
        **scaling_options: the recipe's options: ``history_len`` (16) and
            ``amax_compute_algo`` (``"max"``) for delayed, ``eps`` for dynamic,
            ``margin`` and ``power_of_2`` for both.

    Returns:
        A :class:`Float8Report` naming each linear layer and why it was not converted.
    """
    check_instance("model", model, nn.Module, "an nn.Module",
                   hint="pass the model whose Linear layers should run in float8")  # fmt: skip
    # Validates recipe and options before anything changes.
    template = make_scaling(recipe, "e4m3", **scaling_options)
    Float8Linear(ALIGNMENT, ALIGNMENT, device="meta", recipe=recipe, output_dtype=output_dtype,
                 **scaling_options)  # fmt: skip
    accept = _as_predicate(module_filter)

    parents: dict[int, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    decisions, swaps = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = _why_not(name, module, parents.get(id(module)))
        if not reason and not accept(name, module):
            reason = "excluded by module_filter"
        decisions.append(
            Float8Decision(name, module.in_features, module.out_features, not reason, reason)
        )
        if not reason:
            swaps[id(module)] = Float8Linear.from_linear(
                module, recipe=recipe, output_dtype=output_dtype, **scaling_options
            )
    # Every reference is replaced, so a layer shared by two parents stays shared.
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in swaps:
                setattr(parent, child_name, swaps[id(child)])
    return Float8Report(template.kind, tuple(decisions))
