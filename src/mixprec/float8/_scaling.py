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

import abc
import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

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

# The slots of a scaling's ``state`` vector. Counts take two slots, high and low, each
# an integer below float32's 2**24 (the largest run of exactly representable integers).
# The four values every cast rewrites come first, so that an eager cast writes them with
# one op (a ``torch.stack`` into the vector's head).
_SCALE, _AMAX, _OVERFLOWS, _INV_SCALE, _SATURATED, _NUMEL = 0, 1, 2, 3, 4, 6
# The statistics every cast records (scale, amax, overflows; a rowwise cast writes only
# these), then the head a tensorwise cast writes: those and the inverse scale.
_STATS, _HEAD = _OVERFLOWS + 1, _INV_SCALE + 1
_SLOTS = 8  # recipe state (the delayed history) follows
_COUNT_BASE = 2**24


def _count_slots(count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A count (int64, >= 0) as its two slots ``(count // 2**24, count % 2**24)``."""
    return torch.div(count, _COUNT_BASE, rounding_mode="floor"), count % _COUNT_BASE


def _read_count(state: torch.Tensor, slot: int) -> torch.Tensor:
    return state[slot].long() * _COUNT_BASE + state[slot + 1].long()


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a float32 0-d tensor (0 for an empty ``x``); inf/nan propagate.

    The inf-norm: one op eagerly, the same reduction as ``x.abs().amax()`` compiled.

    >>> tensor_amax(torch.tensor([1.0, -3.0], dtype=torch.bfloat16))
    tensor(3.)
    """
    if not x.numel():  # an empty reduction has no max; nothing is cast anyway
        return x.new_zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(x, math.inf, dtype=torch.float32)


class _StateViews(NamedTuple):
    """A scaling's state vector (``state``), the slots every cast records (``stats``), those
    a tensorwise cast writes (``head``), and each slot (``slots``), as views of its buffer."""

    state: torch.Tensor
    stats: torch.Tensor
    head: torch.Tensor
    slots: tuple[torch.Tensor, ...]


class Float8Scaling(nn.Module, abc.ABC):
    """The interface of a per-tensor float8 scaling; subclasses pick the scale.

    One :meth:`cast`::

        amax = max(|x|)                       # inf/nan if x holds any
        scale = recipe's scale (kept from the last cast if no usable amax)
        data = float8(clamp(x * scale, -fp8_max, fp8_max)), non-finite x -> nan
        record amax, saturated, numel; overflows += amax is not finite
        return data, 1 / scale

    State, read through properties: ``scale`` (the last cast's scale), ``amax`` (the
    last amax seen, as seen: it may be inf/nan), ``saturated`` (elements of the last
    cast that were clipped: more than half a float8 step beyond ``fp8_max`` after
    scaling, so the cast changed them by more than rounding), ``numel`` (elements of
    the last cast; both counted only by recipes that can clip, ``clips``: a dynamic
    cast with a finite amax clips nothing, so its two stay 0) and ``overflows`` (casts
    whose amax was inf/nan, since creation). Non-finite elements become NaN in float8
    (e4m3fn has no infinity) so an overflow reaches the loss scale's inf/nan check
    rather than being clipped to a finite value.

    All of it lives in one float32 buffer, ``state``, rewritten once per cast: under
    ``torch.compile`` every buffer a step writes is a kernel of its own, so one vector
    costs no kernel beyond the cast's own (its update is fused with the inverse scale
    the matmul reads). ``scale``, ``amax`` and ``overflows`` are views of it (float32;
    ``overflows`` counts exactly up to 2**24); ``saturated`` and ``numel`` are int64
    values kept exactly in two slots each. ``state_dict`` holds one entry per value
    (``scale``, ``amax``, ``saturated``, ``numel``, ``overflows``, and the delayed
    ``amax_history``; float32 and int64), not the vector, so checkpoints do not depend
    on the packing.

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
        state = torch.zeros(_SLOTS)
        state[_SCALE] = state[_INV_SCALE] = 1.0
        # Kept as the float32 values' bits in an int32 buffer: a model-wide cast to a low
        # precision (``model.half()``, a level storing parameters and floating buffers in
        # bfloat16) leaves integer buffers alone, and counts and histories must not be
        # rounded. Not saved as such: ``state_dict`` holds one entry per value.
        self.register_buffer("_state_bits", state.view(torch.int32), persistent=False)
        self._register_slots()

    def _register_slots(self) -> None:
        # Each slot's index, for the compiled update's masks. A buffer of this module rather
        # than an arange in the graph: identical aranges of the forward's and the
        # backward's casts would be merged and their masks saved from the forward, each
        # one more kernel there.
        self.register_buffer("_slot", torch.arange(self.state.shape[0]), persistent=False)

    # -- the state, slot by slot ----------------------------------------------------

    @property
    def state(self) -> torch.Tensor:
        """Every value the scaling keeps, as one float32 vector (a view of its buffer)."""
        if torch.compiler.is_compiling():
            return self._state_bits.view(torch.float32)
        return self._eager_views()[0]

    def __getstate__(self) -> dict[str, Any]:
        # The kept views are not state: a copy or a pickle makes its own (and torch.save
        # refuses a float32 view beside the int32 buffer it views).
        state = super().__getstate__()
        state.pop("_state_views", None)
        return state

    def _eager_views(self) -> _StateViews:
        """The views of the buffer an eager cast reads and writes. Eagerly a view is a
        dispatch: they are kept with the buffer they view, and made again when the buffer
        is replaced (``.to()``, ``_apply``, a functional call's swap)."""
        bits = self._state_bits
        cached = self.__dict__.get("_state_views")
        if cached is None or cached[0] is not bits:
            state = bits.view(torch.float32)
            views = _StateViews(state, state[:_STATS], state[:_HEAD], state.unbind())
            cached = self.__dict__["_state_views"] = (bits, views)
        return cached[1]

    @property
    def scale(self) -> torch.Tensor:
        """The last cast's scale (a float32 view of ``state``)."""
        return self.state[_SCALE]

    @property
    def amax(self) -> torch.Tensor:
        """The last cast's amax, as seen: inf/nan if it overflowed (a float32 view)."""
        return self.state[_AMAX]

    @property
    def overflows(self) -> torch.Tensor:
        """Casts whose amax was inf/nan, since creation (a float32 view, exact to 2**24)."""
        return self.state[_OVERFLOWS]

    @property
    def saturated(self) -> torch.Tensor:
        """Elements the last cast clipped (int64; counted only where ``clips``)."""
        return _read_count(self.state, _SATURATED)

    @property
    def numel(self) -> torch.Tensor:
        """Elements of the last cast (int64; counted only where ``clips``)."""
        return _read_count(self.state, _NUMEL)

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
        entries = self._checkpoint_entries()
        given, failed = {}, False
        for name, current in entries.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                failed |= strict
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or value.shape != current.shape:
                shape = value.shape if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from "
                    f"checkpoint, the shape in current model is {current.shape}."
                )
                failed = True
                continue
            given[name] = value
        if strict:
            unexpected_keys.extend(
                key for key in state_dict
                if key.startswith(prefix) and key[len(prefix):] not in entries
            )  # fmt: skip
        if not failed:  # a load that fails changes nothing of this scaling
            with torch.no_grad():
                self.state.copy_(self._state_with(given))

    # -- the checkpoint layout: one entry per value -------------------------------------

    def _checkpoint_entries(self) -> dict[str, torch.Tensor]:
        """The state as ``state_dict`` holds it: the layout of one buffer per value
        (``scale``, ``amax``, ``saturated``, ``numel``, ``overflows``; float32 and int64),
        copies taken now. The packed ``state`` buffer is not saved itself, so checkpoints
        keep this layout whatever the packing."""
        state = self.state.detach()
        return {"scale": state[_SCALE].clone(), "amax": state[_AMAX].clone(),
                "saturated": _read_count(state, _SATURATED),
                "numel": _read_count(state, _NUMEL), "overflows": state[_OVERFLOWS].long()}  # fmt: skip

    def _state_with(self, entries: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``state`` with the checkpoint ``entries`` given (shapes checked) written in."""
        state = self.state.detach().clone()
        if "scale" in entries:  # the inverse is kept beside it, as a cast leaves it
            scale = entries["scale"].to(state)
            state[_SCALE], state[_INV_SCALE] = scale, scale.reciprocal()
        for name, slot in (("amax", _AMAX), ("overflows", _OVERFLOWS)):
            if name in entries:
                state[slot] = entries[name].to(state)
        for name, slot in (("saturated", _SATURATED), ("numel", _NUMEL)):
            if name in entries:
                state[slot], state[slot + 1] = _count_slots(entries[name].to(state.device).long())
        return state

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self._checkpoint_entries().items():
            destination[prefix + name] = value

    # -- the step -------------------------------------------------------------------

    @abc.abstractmethod
    def _candidate(self, state: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(scale, usable)``: this cast's new scale given the current amax and whether it
        is finite (``state`` not yet updated), and whether it replaces the previous one.
        The one formula a recipe must give (the class docstring's ``recipe's scale``)."""

    def _record(self, state: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor) -> None:
        """Update recipe-specific state in place after an eager cast (the delayed history)."""

    def _record_packed(self, state: torch.Tensor, new: torch.Tensor, amax: torch.Tensor,
                       finite: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """:meth:`_record` under ``torch.compile``: ``new`` (the next ``state``) with the
        recipe's slots updated, elementwise (``self._slot`` holds each slot's index)."""
        return new

    def _finish(self, basis: torch.Tensor) -> torch.Tensor:
        """``fp8_max / basis / 2**margin``, rounded down to a power of two if asked (a
        zero or non-finite basis gives an unusable scale: TE's rule keeps the previous)."""
        scale = self.fp8_max / basis
        if self.margin:  # skipped at 0: every op here is one more kernel or dispatch
            scale = scale / 2.0**self.margin
        if self.power_of_2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return scale

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
        # as the recipe needs: eagerly each is a dispatch; compiled, the amax is the one
        # pass before the cast, the cast is one more, and the state's update (with the
        # inverse scale) a third (_write_state).
        return self._cast_with_amax(x, tensor_amax(x))

    def _cast_with_amax(self, x: torch.Tensor, amax: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # ``amax`` is that of ``x``, or of the whole tensor ``x`` is a shard of (all ranks').
        if torch.compiler.is_compiling():
            state = self.state
            head, previous = state, state  # a slot is indexed in the graph
        else:
            state, _, head, previous = self._eager_views()
        # An amax is >= 0 or NaN, so this is isfinite(amax) in one op (NaN < inf is False).
        finite = amax < math.inf
        candidate, usable = self._candidate(state, amax, finite)
        scale = torch.where(usable, candidate, previous[_SCALE])
        saturated = None
        if self.clips and torch.compiler.is_compiling():
            saturated = self._saturation_in_amax_pass(x, state, finite)
        data, counted = self._scaled_data(x, scale, count=self.clips and saturated is None)
        saturated = counted if saturated is None else saturated
        inv_scale = self._write_state(state, head, previous, scale, candidate, usable, amax,
                                      finite, saturated, x.numel())  # fmt: skip
        return data, inv_scale

    def _scaled_data(self, x: torch.Tensor, scale: torch.Tensor, count: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``(data, saturated)``: ``x * scale`` clipped and in float8, non-finite elements
        NaN, and (if ``count``) the number of elements clipped, else ``None``. A finite
        element whose scaled value overflows is clipped (and counted) like any other."""
        saturated = None
        if torch.compiler.is_compiling():
            # Inductor fuses the test and the where into the cast's loop (a nan_to_num, or
            # the where before the scaling, costs kernels of their own).
            finite_x = torch.isfinite(x)
            scaled = x.float() * scale
            clipped = scaled.clamp(-self.fp8_max, self.fp8_max)
            data = torch.where(finite_x, clipped, math.nan).to(self.fp8_dtype)
            if count:
                saturated = self._clipped(x, scale).sum()
            return data, saturated
        # Eagerly each op is a dispatch: nan_to_num makes inf NaN in one, and NaN stays NaN
        # through the clamp and compares False in the count.
        scaled = x.float().nan_to_num(nan=math.nan, posinf=math.nan, neginf=math.nan) * scale
        data = scaled.clamp(-self.fp8_max, self.fp8_max).to(self.fp8_dtype)
        if count:
            saturated = (scaled.abs() > self.clip_threshold).sum()
        return data, saturated

    def _clipped(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Which elements of ``x`` a cast with ``scale`` clips: finite, and beyond the range
        by more than rounding once scaled."""
        return torch.isfinite(x) & ((x.float() * scale).abs() > self.clip_threshold)

    def _saturation_in_amax_pass(self, x: torch.Tensor, state: torch.Tensor,
                                 finite: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """Compiled, for a recipe whose scale is known before ``x`` is read: the saturation
        count as a second reduction of the amax's pass over ``x`` (after the cast, inductor
        leaves it a kernel of its own). ``None``: the scale depends on ``x`` (the default).
        """
        return None

    def _write_state(self, state: torch.Tensor, head: torch.Tensor, previous: Any,
                     scale: torch.Tensor, candidate: torch.Tensor, usable: torch.Tensor,
                     amax: torch.Tensor, finite: torch.Tensor, saturated: torch.Tensor | None,
                     numel: int) -> torch.Tensor:  # fmt: skip
        """Record a cast in ``state``; return its inverse scale (``1 / scale``). The
        saturation count and ``numel`` are recorded where ``saturated`` is given. Eagerly,
        ``head`` and ``previous`` are :meth:`_eager_views`' (``previous``: the slots as the
        cast found them)."""
        if torch.compiler.is_compiling():
            # One elementwise op over the vector in which each slot reads only itself:
            # inductor computes it and writes both the buffer and the inverse scale the
            # matmul reads in one kernel (a slot reading another slot, as the delayed
            # history's roll does, costs one more: the buffer's write is then separate).
            # So the inverse scale is a slot too, kept with the scale where it is kept.
            slot = self._slot
            new = torch.where(slot == _OVERFLOWS, state + ~finite, state)
            new = torch.where(slot == _AMAX, amax, new)
            new = torch.where((slot == _SCALE) & usable, candidate, new)
            new = torch.where((slot == _INV_SCALE) & usable, candidate.reciprocal(), new)
            if saturated is not None:
                counts = (*_count_slots(saturated), numel // _COUNT_BASE, numel % _COUNT_BASE)
                for index, value in enumerate(counts, start=_SATURATED):
                    new = torch.where(slot == index, value, new)
            new = self._record_packed(state, new, amax, finite)
            state.copy_(new)
            return new[_INV_SCALE]
        # Eagerly every op is a dispatch: the slots a cast rewrites are one stack into
        # the vector. The kept inverse is the reciprocal of the kept scale (both are
        # written together), so this is it.
        inv_scale = scale.reciprocal()
        values = (scale, amax, previous[_OVERFLOWS] + ~finite, inv_scale)
        if saturated is None:
            torch.stack(values, out=head)
        else:
            high, low = _count_slots(saturated)
            size = (high.new_full((), numel // _COUNT_BASE), high.new_full((), numel % _COUNT_BASE))
            torch.stack((*values, high, low, *size), out=state[:_SLOTS])
        self._record(state, amax, finite)
        return inv_scale

    def _store(self, scale: torch.Tensor, amax: torch.Tensor) -> None:
        """Record the statistics of a cast made outside :meth:`_cast_with_amax` (a rowwise
        cast, whose inverse scales are per row, leaves the inverse slot as it is): its
        scale, its amax, and one more overflow if the amax is not finite."""
        finite = amax < math.inf
        if torch.compiler.is_compiling():  # one elementwise update, as in _write_state
            state, slot = self.state, self._slot
            new = torch.where(slot == _OVERFLOWS, state + ~finite, state)
            new = torch.where(slot == _SCALE, scale, torch.where(slot == _AMAX, amax, new))
            state.copy_(new)
        else:
            _, stats, _, previous = self._eager_views()
            torch.stack((scale, amax, previous[_OVERFLOWS] + ~finite), out=stats)

    def saturated_fraction(self) -> torch.Tensor:
        """The fraction of the last cast's elements that were clipped (a tensor, no sync)."""
        state = self.state
        saturated = state[_SATURATED] * _COUNT_BASE + state[_SATURATED + 1]
        return saturated / (state[_NUMEL] * _COUNT_BASE + state[_NUMEL + 1]).clamp(min=1)


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

    def _candidate(self, state: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        scale = self._finish(torch.clamp(amax, min=self.eps))
        return scale, finite if self._bounded else finite & torch.isfinite(scale)


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
        history_len: amaxes kept (``amax_history``, newest first: a view of ``state``).
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
        # The history follows the common slots in the one state vector.
        history = torch.zeros(self.history_len, dtype=torch.int32)  # 0.0's bits
        self._state_bits = torch.cat((self._state_bits, history))
        self._register_slots()

    @property
    def amax_history(self) -> torch.Tensor:
        """The last ``history_len`` amaxes, newest first (a float32 view of ``state``)."""
        return self.state[_SLOTS:]

    def _past(self, state: torch.Tensor) -> torch.Tensor:
        """The history's basis for the scale: its max, or its newest amax (0: none yet)."""
        history = state[_SLOTS:]
        return history.amax() if self.amax_compute_algo == "max" else history[0]

    def _candidate(self, state: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        past = self._past(state)
        current = torch.where(finite, amax, 0.0)
        # The basis is finite and >= 0: the scale is usable where it is finite (basis > 0).
        scale = self._finish(torch.where(past > 0, past, current))
        return scale, torch.isfinite(scale)

    def _saturation_in_amax_pass(self, x: torch.Tensor, state: torch.Tensor,
                                 finite: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        # Where the history has a basis (past > 0), or the amax is not finite, the scale is
        # the history's (or the previous one where that is unusable): known before x is
        # read. Otherwise it comes from x's own finite amax and clips nothing (as dynamic).
        past = self._past(state)
        candidate = self._finish(past)
        scale = torch.where(torch.isfinite(candidate), candidate, state[_SCALE])
        return torch.where((past > 0) | ~finite, self._clipped(x, scale).sum(), 0)

    def _record(self, state: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor) -> None:
        history = state[_SLOTS:]
        newest = torch.where(finite, amax, 0.0).reshape(1)
        history.copy_(torch.cat((newest, history[:-1])))

    def _record_packed(self, state: torch.Tensor, new: torch.Tensor, amax: torch.Tensor,
                       finite: torch.Tensor) -> torch.Tensor:  # fmt: skip
        # The roll reads each history slot's neighbour: the one update that is not in
        # place, so inductor writes the buffer in a kernel of its own.
        slot = self._slot
        rolled = torch.where(slot > _SLOTS, state.roll(1), new)
        return torch.where(slot == _SLOTS, torch.where(finite, amax, 0.0), rolled)

    def _checkpoint_entries(self) -> dict[str, torch.Tensor]:
        return {**super()._checkpoint_entries(), "amax_history": self.amax_history.detach().clone()}

    def _state_with(self, entries: Mapping[str, torch.Tensor]) -> torch.Tensor:
        state = super()._state_with(entries)
        if "amax_history" in entries:
            state[_SLOTS:] = entries["amax_history"].to(state)
        return state


#: Recipe name -> scaling class. The rowwise recipes' rows ("rowwise",
#: "rowwise_with_gw_hp") are added by :mod:`mixprec.float8._rowwise`, which builds on
#: this module (importing it here would be a cycle); the package imports both.
RECIPES: dict[str, type[Float8Scaling]] = {"dynamic": DynamicScaling, "delayed": DelayedScaling}


def make_scaling(recipe: Any, fp8_dtype: Any, **options: Any) -> Float8Scaling:
    """A fresh scaling for ``fp8_dtype`` from a recipe name and its options.

    ``recipe`` is a name in :data:`RECIPES` (``"dynamic"``, ``"delayed"``, ``"rowwise"``,
    ``"rowwise_with_gw_hp"``) or a :class:`Float8Scaling` whose
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
            f"recipe must be one of {', '.join(map(repr, RECIPES))} or a Float8Scaling, "
            f"got {type(recipe).__name__} {recipe!r}"
        )
    cls = RECIPES[check_choice("recipe", recipe, RECIPES)]
    accepted = sorted(set(cls._config_names()) - {"fp8_dtype"})
    for name in options:
        if name not in accepted:
            raise ValueError(
                f"{name} is not an option of recipe={recipe!r}; its options: {', '.join(accepted)}"
            )
    return cls(fp8_dtype, **options)
