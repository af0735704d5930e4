"""Per-tensor float8 scaling: small state machines that pick the scale of each cast.

A float8 cast multiplies a tensor by a scale so that its largest magnitude (its
*amax*) lands near the top of the float8 range, rounds it to float8 and keeps
``1 / scale`` to undo the scaling after the matmul. Two recipes choose the scale:

* :class:`DynamicScaling` - from the amax of the tensor being cast (exact range,
  one extra reduction before the cast);
* :class:`DelayedScaling` - from a rolling history of past amaxes (the scale is
  known before the tensor is read; values beyond the history's range are clipped
  and counted).

Each scaling is an ``nn.Module`` whose state lives in buffers (so a model's
``state_dict`` carries it) and whose hyperparameters are its constructor
arguments (``get_config()`` / ``from_config()`` round-trip them). Every update is
branch-free tensor arithmetic: no call on the step path reads a value back to the
host, so the casts run under ``torch.compile`` and CUDA graphs.

>>> scaling = DynamicScaling("e4m3")
>>> data, inv_scale = scaling.cast(torch.tensor([0.5, -2.0, 1.0]))
>>> data.dtype, scaling.scale, data.float() * inv_scale
(torch.float8_e4m3fn, tensor(224.), tensor([ 0.5000, -2.0000,  1.0000]))
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from mixprec._checks import (
    FLOAT8_NAMES,
    as_float8_dtype,
    check_bool,
    check_choice,
    check_instance,
    check_number,
)


class Float8Scaling(nn.Module):
    """The interface of a per-tensor float8 scaling; subclasses pick the scale.

    One :meth:`cast`::

        amax = max(|x|)                       # inf/nan if x holds any
        scale = recipe's scale (kept from the last cast if no usable amax)
        data = float8(clamp(x * scale, -fp8_max, fp8_max)), non-finite x -> nan
        record amax, saturated, numel; overflows += amax is not finite
        return data, 1 / scale

    Buffers: ``scale`` (the last cast's scale), ``amax`` (the last amax seen, as
    seen: it may be inf/nan), ``saturated`` (elements of the last cast that were
    clipped: more than half a float8 step beyond ``fp8_max`` after scaling, so the
    cast changed them by more than rounding), ``numel`` (elements of the last cast;
    both counted only by recipes that can clip, ``clips``: a dynamic cast with a
    finite amax clips nothing, so its two stay 0) and ``overflows`` (casts whose amax was inf/nan, since creation). Non-finite
    elements become NaN in float8 (e4m3fn has no infinity) so an overflow reaches the
    loss scale's inf/nan check rather than being clipped to a finite value.

    Args:
        fp8_dtype: ``"e4m3"`` (3 mantissa bits, max 448) or ``"e5m2"`` (max 57344).
        margin: the scale is divided by ``2**margin`` (headroom against growth).
        power_of_2: round the scale down to a power of two, so scaling is exact.
    """

    kind: ClassVar[str] = "base"
    #: Whether a cast can clip finite elements, so that saturation is counted.
    clips: ClassVar[bool] = True

    def __init__(self, fp8_dtype: Any = "e4m3", *, margin: float = 0, power_of_2: bool = False):
        super().__init__()
        self.fp8_dtype = as_float8_dtype(fp8_dtype)
        self.margin = check_number("margin", margin, minimum=0, hint="pass e.g. margin=0")
        self.power_of_2 = check_bool("power_of_2", power_of_2)
        info = torch.finfo(self.fp8_dtype)
        self.fp8_max = float(info.max)
        # Half a float8 step above the max still rounds to the max: not clipped.
        self.clip_threshold = self.fp8_max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
        for name, dtype, value in (("scale", torch.float32, 1.0), ("amax", torch.float32, 0.0),
                                   ("saturated", torch.int64, 0), ("numel", torch.int64, 0),
                                   ("overflows", torch.int64, 0)):  # fmt: skip
            self.register_buffer(name, torch.tensor(value, dtype=dtype))

    # -- hyperparameters ------------------------------------------------------------

    @classmethod
    def _config_names(cls) -> list[str]:
        # The constructor's arguments are the configuration, so none can be forgotten.
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def get_config(self) -> dict[str, Any]:
        """Hyperparameters as a plain dict; ``type(self).from_config(cfg)`` rebuilds it."""
        return {name: getattr(self, name) for name in self._config_names()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Float8Scaling:
        """Build a scaling from :meth:`get_config`'s output (fresh state).

        >>> DelayedScaling.from_config(DelayedScaling(history_len=4).get_config()).history_len
        4
        """
        unknown = set(config) - set(cls._config_names())
        if unknown:
            raise ValueError(
                f"config has keys {sorted(unknown)} that {cls.__name__} does not take; "
                f"accepted keys: {sorted(cls._config_names())}"
            )
        return cls(**config)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:  # fmt: skip
        # A checkpoint of the plain architecture (pretrained weights, or a model saved
        # before convert_to_float8) has no entry of this scaling at all: loading it with
        # strict=True keeps the scaling's current state instead of failing on keys that
        # no plain model has. One entry present and another absent is a damaged
        # float8 checkpoint, and stays an error.
        if not any(key.startswith(prefix) for key in state_dict):
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)  # fmt: skip

    # -- the step -------------------------------------------------------------------

    def _scale_from(self, amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """This cast's scale given the current amax and whether it is finite (state not
        yet updated)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _scale_from")

    def _record(self, amax: torch.Tensor, finite: torch.Tensor) -> None:
        """Update recipe-specific state after a cast (the history, for delayed)."""

    def _finish(self, basis: torch.Tensor, usable: torch.Tensor | None) -> torch.Tensor:
        """``fp8_max / basis / 2**margin`` (rounded down to a power of two if asked), or the
        previous scale where it is not usable (TE's rule: a zero or non-finite basis keeps
        the previous scale). ``usable`` None: usable where the new scale is finite."""
        scale = self.fp8_max / basis
        if self.margin:  # skipped at 0: every op here is one more kernel or dispatch
            scale = scale / 2.0**self.margin
        if self.power_of_2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        if usable is None:
            usable = torch.isfinite(scale)
        return torch.where(usable, scale, self.scale)

    def cast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(data, inv_scale)``: ``x * scale`` in float8 and ``1 / scale`` (float32).

        Updates the state in place; no host sync.
        """
        check_instance("x", x, torch.Tensor, "a torch.Tensor")
        if not x.is_floating_point() or x.dtype in FLOAT8_NAMES.values():
            raise TypeError(f"x must be a float32/bfloat16/float16 tensor, got {x.dtype}")
        return self._cast(x.detach())

    def _cast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The float8 layers' hot path (their input was checked once). Written as few ops
        # as the recipe needs: eagerly each is a dispatch, compiled each scalar result
        # the state keeps is a store; the amax is the one pass before the cast, and the
        # cast, its saturation count and the non-finite test are one more, fused.
        amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
        finite = torch.isfinite(amax)
        scale = self._scale_from(amax, finite)
        scaled = x.float() * scale
        finite_x = torch.isfinite(x)
        clipped = scaled.clamp(-self.fp8_max, self.fp8_max)
        data = torch.where(finite_x, clipped, math.nan).to(self.fp8_dtype)
        if self.clips:  # each buffer written is one more kernel under torch.compile
            self.saturated.copy_((finite_x & (scaled.abs() > self.clip_threshold)).sum())
            self.numel.fill_(x.numel())
        self._record(amax, finite)
        self.scale.copy_(scale)
        self.amax.copy_(amax)
        self.overflows.add_(~finite)
        return data, scale.reciprocal()

    def saturated_fraction(self) -> torch.Tensor:
        """The fraction of the last cast's elements that were clipped (a tensor, no sync)."""
        return self.saturated.float() / self.numel.clamp(min=1).float()


class DynamicScaling(Float8Scaling):
    """Scale from the current tensor: ``scale = fp8_max / max(amax, eps) / 2**margin``.

    Nothing is clipped (up to rounding); an inf/nan amax keeps the previous scale
    and counts an overflow.

    >>> s = DynamicScaling("e4m3", power_of_2=True)
    >>> _ = s.cast(torch.tensor([3.0, -1.0])); s.scale
    tensor(128.)
    """

    kind: ClassVar[str] = "dynamic"
    # The amax lands at fp8_max / 2**margin: a cast with a finite amax clips nothing
    # (float rounding of amax * scale stays within half a float8 step), and one with a
    # non-finite amax is an overflow, counted as such. No saturation pass is needed.
    clips: ClassVar[bool] = False

    def __init__(self, fp8_dtype: Any = "e4m3", *, margin: float = 0, power_of_2: bool = False,
                 eps: float = 1e-12):  # fmt: skip
        super().__init__(fp8_dtype, margin=margin, power_of_2=power_of_2)
        self.eps = check_number("eps", eps, minimum=0, exclusive=True, hint="pass e.g. eps=1e-12")
        # With eps bounding the basis below, a finite amax gives a finite scale unless
        # fp8_max / eps overflows float32: then the scale itself must be tested.
        self._bounded = self.fp8_max / self.eps / 2.0**self.margin < torch.finfo(torch.float32).max

    def _scale_from(self, amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        scale = self._finish(torch.clamp(amax, min=self.eps), finite if self._bounded else None)
        return scale if self._bounded else torch.where(finite, scale, self.scale)


class DelayedScaling(Float8Scaling):
    """Scale from a rolling history of past amaxes, as in Transformer Engine's recipe.

    One cast::

        basis = max(history) if amax_compute_algo == "max" else history[0]
        if basis == 0: basis = amax if finite(amax) else 0   # nothing seen yet
        scale = fp8_max / basis / 2**margin  (previous scale if basis == 0)
        cast x with scale; elements beyond the range are clipped and counted
        history = [amax if finite(amax) else 0] + history[:-1]   # rolling, newest first

    An inf/nan amax carries no range information: it is recorded as 0 (so it cannot
    poison the history for ``history_len`` steps) and counted in ``overflows``. The
    first cast, with an empty history, uses the current amax (as if dynamic).

    Args:
        history_len: amaxes kept (``amax_history`` buffer, newest first).
        amax_compute_algo: ``"max"`` over the history or the ``"most_recent"`` one.

    >>> s = DelayedScaling("e4m3", history_len=2)
    >>> for v in (1.0, 4.0, 2.0): _ = s.cast(torch.tensor([v]))
    >>> s.scale, s.amax_history      # this scale came from max(4, 1)
    (tensor(112.), tensor([2., 4.]))
    """

    kind: ClassVar[str] = "delayed"

    def __init__(self, fp8_dtype: Any = "e4m3", *, margin: float = 0, power_of_2: bool = False,
                 history_len: int = 16, amax_compute_algo: str = "max"):  # fmt: skip
        super().__init__(fp8_dtype, margin=margin, power_of_2=power_of_2)
        self.history_len = check_number(
            "history_len", history_len, integer=True, minimum=1, hint="pass e.g. history_len=16"
        )
        self.amax_compute_algo = check_choice(
            "amax_compute_algo", amax_compute_algo, ("max", "most_recent")
        )
        self.register_buffer("amax_history", torch.zeros(self.history_len))

    def _scale_from(self, amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        history = self.amax_history
        past = history.amax() if self.amax_compute_algo == "max" else history[0]
        current = torch.where(finite, amax, 0.0)
        # The basis is finite and >= 0: the scale is usable where it is finite (basis > 0).
        return self._finish(torch.where(past > 0, past, current), None)

    def _record(self, amax: torch.Tensor, finite: torch.Tensor) -> None:
        newest = torch.where(finite, amax, 0.0).reshape(1)
        self.amax_history.copy_(torch.cat((newest, self.amax_history[:-1])))


RECIPES: dict[str, type[Float8Scaling]] = {"dynamic": DynamicScaling, "delayed": DelayedScaling}


def make_scaling(recipe: Any, fp8_dtype: Any, **options: Any) -> Float8Scaling:
    """A fresh scaling for ``fp8_dtype`` from a recipe name and its options.

    ``recipe`` is ``"dynamic"``, ``"delayed"`` or a :class:`Float8Scaling` whose
    configuration is copied (with ``fp8_dtype`` replaced; options not allowed then).
    Options a recipe does not take are an error.

    >>> make_scaling("delayed", "e5m2", history_len=8)
    DelayedScaling(fp8_dtype=torch.float8_e5m2, margin=0.0, power_of_2=False, history_len=8, amax_compute_algo='max')
    >>> make_scaling("dynamic", "e4m3", history_len=8)
    Traceback (most recent call last):
    ...
    ValueError: history_len is not an option of recipe='dynamic'; its options: eps, margin, power_of_2
    """
    if isinstance(recipe, Float8Scaling):
        if options:
            raise ValueError(
                f"options {sorted(options)} cannot be combined with a Float8Scaling recipe; "
                "set them on the scaling object or pass the recipe by name"
            )
        return type(recipe).from_config({**recipe.get_config(), "fp8_dtype": fp8_dtype})
    if not isinstance(recipe, str):
        raise TypeError(
            f"recipe must be 'dynamic', 'delayed' or a Float8Scaling, got "
            f"{type(recipe).__name__} {recipe!r}"
        )
    cls = RECIPES[check_choice("recipe", recipe, RECIPES)]
    accepted = sorted(set(cls._config_names()) - {"fp8_dtype"})
    for name in options:
        if name not in accepted:
            raise ValueError(
                f"{name} is not an option of recipe={recipe!r}; its options: {', '.join(accepted)}"
            )
    return cls(fp8_dtype, **options)
