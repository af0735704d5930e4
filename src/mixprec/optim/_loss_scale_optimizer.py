"""``LossScaleOptimizer``: wraps any ``torch.optim.Optimizer`` with loss scaling.

One ``step()``, top to bottom in :meth:`LossScaleOptimizer.step`: gradients ->
(master gradients) -> unscale + finite check -> (accumulate) -> ranks agree -> clip
-> decoupled weight decay -> inner step, skipped on overflow -> EMA -> (copy masters
back) -> update the loss scale -> count. The step protocol itself (unscale, agree,
step or skip, update, the saved form of a loss scale) is :mod:`mixprec.loss_scale`'s;
what is stepped is :mod:`mixprec.optim.masters`'s. The only host read is the
``found_inf.item()`` of a non-fused inner step; fused ones skip on the device.

The wrapper is a real ``torch.optim.Optimizer`` built through torch's constructor
(its step and state-dict hooks, profiling name and ``_patch_step_function`` are
torch's own); from then on its ``param_groups``, ``state`` and ``defaults`` *are* the
inner optimizer's, so LR schedulers, ``clip_grad_norm_`` over ``param_groups`` and
anything else that reads optimizer state see one set of groups. Hyperparameters of
the inner optimizer (the names in its ``defaults``: ``lr``, ``momentum``, ``betas``
...) read from its first group and write to all its groups (``opt.lr = 0.1``).

Its checkpoint is torch's shape: the inner optimizer's ``state`` and
``param_groups`` at the top, plus ``"mixprec"``: the loss scale
(:func:`~mixprec.loss_scale.loss_scale_state`), the step counters and the optional
parts (master weights, EMA, gradient accumulation); ``weights_only``-loadable.
Loading checks everything before it changes anything. A state dict with only
``state`` and ``param_groups`` (what ``torch.distributed.checkpoint``'s
``set_state_dict`` passes) loads the inner optimizer and keeps the wrapper's own state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from mixprec._checks import check_bool, check_number, low_precision_of
from mixprec.loss_scale import (
    LossScale,
    agree_on_found_inf,
    check_process_group,
    checked_loss_scale,
    loss_scale_from_spec,
    loss_scale_state,
    reduction_group,
    refuse_unscaled_gradients,
    restore_loss_scale,
)
from mixprec.numerics import cpu_shortcuts, is_flat_shard, unscale_and_check_
from mixprec.optim._accumulation import GradientAccumulator
from mixprec.optim._clipping import clip_gradients_
from mixprec.optim._ema import ParameterEMA
from mixprec.optim.masters import build_masters, mode_of

if TYPE_CHECKING:
    from mixprec.typing import LossScaleSpec
    from mixprec.typing import MasterWeights as MasterWeightsOption



class _FromInner:
    """A field that is the inner optimizer's once there is one (before: the wrapper's own)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        inner = obj.__dict__.get("_inner")
        if inner is None:
            try:
                return obj.__dict__[self.name]
            except KeyError:
                raise AttributeError(self.name) from None
        return getattr(inner, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        inner = obj.__dict__.get("_inner")
        if inner is None:
            obj.__dict__[self.name] = value
        else:
            setattr(inner, self.name, value)


class OptimizerWrapper(torch.optim.Optimizer):
    """An optimizer whose groups, state and hyperparameters are ``inner``'s.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = OptimizerWrapper(torch.optim.SGD([w], lr=0.5, momentum=0.9))
    >>> opt.lr, opt.param_groups is opt.inner_optimizer.param_groups
    (0.5, True)
    >>> opt.momentum = 0.8; opt.inner_optimizer.param_groups[0]["momentum"]
    0.8
    """

    #: The wrapper's own public attributes: never delegated to the inner groups, even
    #: where the inner optimizer has a hyperparameter of that name (AdamW's
    #: ``decoupled_weight_decay``). Private (``_``) names are always the wrapper's.
    own_attributes: ClassVar[frozenset[str]] = frozenset()

    param_groups = _FromInner()
    state = _FromInner()
    defaults = _FromInner()

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}"
            )
        # torch's constructor sets up hooks and (re)normalises the inner groups in place;
        # the groups, state and defaults it builds are dropped for the inner ones below.
        super().__init__(inner.param_groups, inner.defaults)
        for name in ("param_groups", "state", "defaults"):
            self.__dict__.pop(name, None)
        self.__dict__["_inner"] = inner

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "_inner" not in self.__dict__:  # torch's constructor, on the inner groups
            super().add_param_group(param_group)
        else:
            self._inner.add_param_group(param_group)

    def _is_hyperparameter(self, name: str) -> bool:
        inner = self.__dict__.get("_inner")
        return inner is not None and name != "params" and name in inner.defaults

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: delegate inner hyperparameters.
        if self._is_hyperparameter(name):
            return self._inner.param_groups[0][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        own = name.startswith("_") or name in self.own_attributes or hasattr(type(self), name)
        if own or not self._is_hyperparameter(name):
            object.__setattr__(self, name, value)
        else:
            for group in self._inner.param_groups:
                group[name] = value

    def __dir__(self) -> list[str]:
        inner = self.__dict__.get("_inner")
        names = [] if inner is None else [n for n in inner.defaults if n != "params"]
        return sorted(set(super().__dir__()) | set(names))

    # -- checkpoints: torch's optimizer state-dict hooks run around the subclass's own --

    def _own_state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def _load_own_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        """The state dict, with torch's ``register_state_dict_pre_hook``/``post_hook``s run."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self._own_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, with torch's ``register_load_state_dict_pre_hook``/``post_hook``s run."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        self._load_own_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._patch_step_function()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"


@dataclasses.dataclass
class _Pending:
    """What one step's ``scale_loss`` and ``unscale_`` leave for its ``step``. One object,
    changed in place, not attributes set on the optimizer: a proxy that forwards
    attribute reads to the optimizer and runs its methods with itself as ``self``
    (Lightning's ``LightningOptimizer``, on whose ``zero_grad()`` manual loops call) then
    changes this optimizer's state, where an assignment would set the proxy's own."""

    scale_used: torch.Tensor | None = None  # the scale scale_loss multiplied by
    unscaled_found_inf: torch.Tensor | None = None  # set by unscale_()


class StepCounters:
    """Applied and skipped steps (int64 tensors) and whether the last step was skipped.

    Counting a step costs three scalar kernels and no host sync: the steps taken and the
    steps skipped are counted, and the applied ones are their difference, taken when read.
    """

    def __init__(self) -> None:
        self.steps = torch.zeros((), dtype=torch.int64)  # recorded, plus any set offset
        self.skipped = torch.zeros((), dtype=torch.int64)
        self.last_skipped = torch.zeros((), dtype=torch.bool)

    @property
    def applied(self) -> torch.Tensor:
        """Applied (not skipped) steps, a new int64 tensor."""
        return self.steps - self.skipped

    def _follow(self, device: torch.device) -> None:
        # A one-time move to the gradients' device: counting never copies a flag back.
        if self.steps.device != device:
            self.steps = self.steps.to(device)
            self.skipped = self.skipped.to(device)
            self.last_skipped = self.last_skipped.to(device)

    def record(self, found_inf: torch.Tensor) -> None:
        """Count one step: skipped if ``found_inf`` (a 0/1 float tensor) is 1. No host sync."""
        if self.steps.device != found_inf.device:
            self._follow(found_inf.device)
        self.last_skipped = found_inf > 0  # a new tensor: nothing else writes it
        self.skipped.add_(self.last_skipped)
        self.steps.add_(1)

    def set_applied(self, value: Any) -> None:
        """Set the applied-step count (``opt.iterations = n``), e.g. when resuming."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = int(value)
        check_number("iterations", value, integer=True, minimum=0)
        self.steps.copy_(self.skipped + value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "iterations": self.applied,
            "skipped_steps": self.skipped.clone(),
            "last_step_skipped": self.last_skipped.clone(),
        }

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` is :meth:`state_dict`'s output."""
        keys = {"iterations", "skipped_steps", "last_step_skipped"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"counters must be a dict with keys {sorted(keys)}, got {state!r}")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"counters[{key!r}] must be a one-element tensor, got {value!r}")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.check_state(state)
        self.skipped.copy_(state["skipped_steps"].reshape(()))
        self.steps.copy_(self.skipped + state["iterations"].reshape(()))
        self.last_skipped = state["last_step_skipped"].reshape(()).to(self.steps.device, torch.bool)


def _check_threshold(name: str, value: Any) -> None:
    check_number(name, value, minimum=0, exclusive=True, allow_none=True)


def check_clip_options(clipnorm: Any, clipvalue: Any, global_clipnorm: Any) -> None:
    """Validate the clipping options together (``clipnorm`` excludes ``global_clipnorm``)."""
    _check_threshold("clipnorm", clipnorm)
    _check_threshold("clipvalue", clipvalue)
    _check_threshold("global_clipnorm", global_clipnorm)
    if clipnorm is not None and global_clipnorm is not None:
        raise ValueError(
            f"clipnorm={clipnorm!r} and global_clipnorm={global_clipnorm!r} were both set; "
            "they clip the same thing two ways, so set at most one of them"
        )


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


def check_options(
    inner_optimizer: torch.optim.Optimizer,
    *,
    master_weights: Any,
    clipnorm: Any,
    clipvalue: Any,
    global_clipnorm: Any,
    weight_decay: Any,
    use_ema: Any,
    ema_momentum: Any,
    ema_overwrite_frequency: Any,
    loss_scale_factor: Any,
    gradient_accumulation_steps: Any,
    skip_nonfinite: Any,
    process_group: Any = None,
    monitor_every: Any = None,
) -> int | None:
    """Raise ``TypeError``/``ValueError`` for a bad option; return the accumulation steps.

    >>> import torch
    >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> check_options(sgd, master_weights=False, clipnorm=None, clipvalue=None,
    ...               global_clipnorm=None, weight_decay=None, use_ema=False, ema_momentum=0.99,
    ...               ema_overwrite_frequency=None, loss_scale_factor=None,
    ...               gradient_accumulation_steps=4, skip_nonfinite=True)
    4
    """
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}"
        )
    if hasattr(inner_optimizer, "loss_scaler"):
        raise ValueError(
            "inner_optimizer is already a LossScaleOptimizer; wrap the plain optimizer once"
        )
    check_clip_options(clipnorm, clipvalue, global_clipnorm)
    check_number("monitor_every", monitor_every, integer=True, minimum=1, allow_none=True)
    check_number("weight_decay", weight_decay, minimum=0, allow_none=True)
    check_number(
        "loss_scale_factor", loss_scale_factor, minimum=0, exclusive=True, allow_none=True
    )
    accumulation = check_number(
        "gradient_accumulation_steps", gradient_accumulation_steps, integer=True, minimum=1,
        allow_none=True, hint="use 1 (or None) for no accumulation",
    )  # fmt: skip
    check_bool("use_ema", use_ema)
    check_bool("skip_nonfinite", skip_nonfinite)
    if use_ema:
        ParameterEMA([], ema_momentum, ema_overwrite_frequency)  # validates only
    mode = mode_of(master_weights)
    mode.check(inner_optimizer)
    if use_ema and not mode.ema:
        raise ValueError(
            f"use_ema=True needs float32 masters that live between steps, and "
            f"master_weights={mode.name!r} rebuilds them only for the step; "
            "use master_weights='fp32' with use_ema=True"
        )
    check_process_group(process_group)
    check_sharded_options(inner_optimizer, clipnorm)
    return accumulation


class LossScaleOptimizer(OptimizerWrapper):
    """An optimizer that applies loss scaling (and mixed-precision extras) to another::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
        opt.scale_loss(loss).backward()     # loss * scale
        opt.step()                          # unscale, check, skip or apply, update scale
        opt.zero_grad()

    ``loss_scale``: ``"dynamic"`` (default: :class:`~mixprec.DynamicLossScale` from 2**15),
    a number (fixed), ``None`` (no scaling, overflows still skipped) or a ``LossScale``.

    Every step whose (unscaled) gradients hold an inf or NaN is skipped: parameters,
    inner state, EMA and decay stay exactly as they were; ``iterations`` does not advance.

    Options (all act on *unscaled* gradients and only on applied steps):
        clipnorm: clip each gradient's L2 norm to this.
        clipvalue: clamp gradient elements to ``[-clipvalue, clipvalue]`` (applied first).
        global_clipnorm: clip the joint norm of all gradients (excludes ``clipnorm``).
        weight_decay: decoupled ``p -= lr * weight_decay * p`` (``opt.decoupled_weight_decay``).
        use_ema, ema_momentum, ema_overwrite_frequency: float32 averages (copy_ema_to_params).
        loss_scale_factor: a fixed extra factor on the loss, removed from the gradients.
        gradient_accumulation_steps: step every N ``step()`` calls on the average gradient;
            one overflowing micro-batch skips the window (``zero_grad()`` after each).
        master_weights: True/"fp32" (float32 masters are stepped), "split"/"split8" (float32
            masters rebuilt from the bfloat16 weight and 16/8 stored bits), "kahan" or "stochastic"
            (the low-precision parameters are stepped, updates kept: see mixprec.optim.masters).
        skip_nonfinite: ``False`` applies every step, even one with inf/NaN gradients.
        process_group: the ranks that skip together: ``None`` (default) all ranks once
            ``torch.distributed`` runs on more than one, a ``ProcessGroup`` (e.g. the
            data-parallel group), or ``"local"`` (each rank decides alone).
        monitor_every: sample gradient precision every N steps, no syncs in between
            (``opt.gradient_monitor``, a :class:`~mixprec.diagnostics.GradientMonitor`).

    ``param_groups``, ``state``, ``opt.lr`` are the inner optimizer's. Counters are tensors:
    ``iterations``, ``skipped_steps``, ``last_step_skipped``. Host syncs per ``step()``:
    none for fused inner optimizers after their first step, one otherwise.

    >>> var = torch.tensor(1.0, requires_grad=True)
    >>> opt = LossScaleOptimizer(torch.optim.SGD([var], lr=0.25))
    >>> opt.scale_loss(var**2).backward(); opt.step()
    >>> var
    tensor(0.5000, requires_grad=True)
    >>> opt.lr, float(opt.loss_scale), int(opt.iterations)
    (0.25, 32768.0, 1)
    """

    own_attributes: ClassVar[frozenset[str]] = frozenset(
        ("loss_scaler", "clipnorm", "clipvalue", "global_clipnorm", "decoupled_weight_decay",
         "loss_scale_factor", "skip_nonfinite", "gradient_accumulation_steps", "process_group",
         "gradient_monitor")
    )  # fmt: skip

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        loss_scale: LossScaleSpec = "dynamic",
        *,
        master_weights: MasterWeightsOption = False,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        skip_nonfinite: bool = True,
        process_group: Any = None,
        monitor_every: int | None = None,
    ) -> None:
        # Validate everything before touching the inner optimizer: a rejected
        # construction must leave it exactly as it was.
        accumulation = check_options(
            inner_optimizer, master_weights=master_weights, clipnorm=clipnorm,
            clipvalue=clipvalue, global_clipnorm=global_clipnorm, weight_decay=weight_decay,
            use_ema=use_ema, ema_momentum=ema_momentum, process_group=process_group,
            monitor_every=monitor_every,
            ema_overwrite_frequency=ema_overwrite_frequency, loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps, skip_nonfinite=skip_nonfinite,
        )  # fmt: skip
        scaler = loss_scale_from_spec(loss_scale)
        super().__init__(inner_optimizer)
        self.loss_scaler: LossScale = scaler
        self.clipnorm, self.clipvalue, self.global_clipnorm = clipnorm, clipvalue, global_clipnorm
        self.decoupled_weight_decay = weight_decay
        self.loss_scale_factor = loss_scale_factor
        self.skip_nonfinite = skip_nonfinite
        self.gradient_accumulation_steps = accumulation
        self.process_group = process_group
        self._pending = _Pending()  # what scale_loss and unscale_ leave for the step
        self._held_grads: dict[int, torch.Tensor] = {}  # a no_sync() window's gradients
        self._master = build_masters(inner_optimizer, master_weights)
        self._accumulator = GradientAccumulator(accumulation) if accumulation else None
        params = self._stepped_params()
        self._ema = ParameterEMA(params, ema_momentum, ema_overwrite_frequency) if use_ema else None
        self._counters = StepCounters()  # tensors: correct under torch.compile, no syncs
        scaler.take_scaled(self)  # from now on, step() asks whether a loss was scaled
        scaler.join(self)  # a scale shared with other optimizers updates once per iteration
        self.gradient_monitor = None
        if monitor_every is not None:  # diagnostics load only when asked for
            from mixprec.diagnostics._monitor import GradientMonitor

            self.gradient_monitor = GradientMonitor(
                self, every=monitor_every, dtype=low_precision_of(self.model_params())
            )

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self._inner!r}, loss_scale={self.loss_scaler!r})"

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.loss_scaler.join(self)  # a copy shares its (copied) scale as the original did

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (float32 scalar tensor)."""
        return self.loss_scaler.scale

    @property
    def iterations(self) -> torch.Tensor:
        """Applied (not skipped) steps, an int64 tensor; assignable (``opt.iterations = 0``)."""
        return self._counters.applied

    @iterations.setter
    def iterations(self, value: Any) -> None:
        self._counters.set_applied(value)

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped because of non-finite gradients, an int64 tensor."""
        return self._counters.skipped.clone()

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """Whether the last step was skipped, a bool tensor (reading it syncs)."""
        return self._counters.last_skipped.clone()

    @property
    def unscaled(self) -> bool:
        """Whether :meth:`unscale_` ran since the last :meth:`step` (or the dropped step
        of :meth:`zero_grad`): the gradients are then the true ones, and a second
        ``unscale_()`` is an error. Trainer integrations unscale once by it."""
        return self._pending.unscaled_found_inf is not None

    @property
    def unscaled_found_inf(self) -> torch.Tensor | None:
        """The verdict :meth:`unscale_` took for the coming step (a 0/1 float32 tensor:
        1 if an unscaled gradient held an inf or NaN), or ``None`` when no ``unscale_()``
        ran since the last step. :meth:`step` goes by it (after the ranks agree), so a
        trainer that must know whether the step will be skipped reads it rather than
        checking the gradients again. Reading its value syncs."""
        return self._pending.unscaled_found_inf

    @property
    def use_ema(self) -> bool:
        return self._ema is not None

    @property
    def master_weights(self) -> bool | str:  # False, True (float32), or the mode's name
        return self._master.option

    def _factor(self) -> float:
        return 1.0 if self.loss_scale_factor is None else float(self.loss_scale_factor)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale * loss_scale_factor``; call ``.backward()`` on the result.

        ``step()`` unscales by the scale used here (a device-side copy), so a loss scale
        shared with an optimizer that steps (and backs off) first stays correct. No sync.
        """
        factor = 1.0 if self.loss_scale_factor is None else float(self.loss_scale_factor)
        scaled = self.loss_scaler.scale_loss(loss, factor)
        self._pending.scale_used = self.loss_scaler.scale.detach().clone()
        return scaled

    def _stepped_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates (masters under master weights)."""
        return [p for g in self._inner.param_groups for p in g["params"]]

    def unscale_(self) -> torch.Tensor:
        """Divide this step's gradients by the loss scale now, in place (once per step);
        return ``found_inf`` (1.0 if any unscaled gradient is inf/NaN; no sync).

        ``GradScaler.unscale_``'s recipe: clipping then sees true gradients, and
        :meth:`step` does not unscale again::

            opt.scale_loss(loss).backward()
            opt.unscale_(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()

        Under master weights (``"fp32"``, ``"split"``) the model's parameters show their
        float32 masters until :meth:`step` (or :meth:`zero_grad`): ``p.data`` and
        ``p.grad`` are the master's, so clipping ``model.parameters()`` or reading
        ``p.grad`` in a hook acts on exactly the unscaled gradients that are stepped;
        the step gives the parameters their low-precision storage back, with the
        unscaled (clipped) gradients in ``.grad``. Once per step.
        """
        return self._take_verdict("unscale_", divide=True)

    def check_unscaled_(self) -> torch.Tensor:
        """For gradients that are already unscaled (divided by the scale elsewhere, by
        hand or by a framework's own unscaling call): check them for inf/NaN without
        dividing them, and return ``found_inf`` (no sync). From here on it is as after
        :meth:`unscale_`: the masters show in the model, clipping acts on what is
        stepped, and :meth:`step` (or the dropped step of :meth:`zero_grad`) goes by this
        verdict. Gradients that came from no :meth:`scale_loss` are taken. Once per step.

        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.5))
        >>> w.grad = torch.tensor([1.0, 2.0])  # true gradients, not multiplied by the scale
        >>> float(opt.check_unscaled_()); opt.step(); w.detach().tolist()
        0.0
        [0.5, 0.0]
        """
        return self._take_verdict("check_unscaled_", divide=False)

    def _take_verdict(self, name: str, divide: bool) -> torch.Tensor:
        """:meth:`unscale_` (``divide``) or :meth:`check_unscaled_`: the pending verdict."""
        if self._pending.unscaled_found_inf is not None:
            raise RuntimeError(
                f"{name}() has already been called since the last step(); call it once per step"
            )
        self._pending.unscaled_found_inf = self._unscale(self._stepped_params(), not divide)
        self._master.show_masters_in_model()
        return self._pending.unscaled_found_inf

    def _unscale(
        self, params: list[torch.Tensor], unscaled: bool, fused: bool = False
    ) -> torch.Tensor:
        """Copy to masters (unless a ``fused`` step reads the model's gradients), unscale
        (unless ``unscaled``) and check; return ``found_inf``."""
        scaler = self.loss_scaler
        if not unscaled and not scaler.take_scaled(self):
            refuse_unscaled_gradients(scaler, self._inner.param_groups)
        if not fused:
            self._master.grads_to_masters()
        grads = []
        for p in params:  # coalesce_sparse_half_grads_, written out: it runs every step
            g = p.grad
            if g is not None and g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
                p.grad = g = g.coalesce()
            grads.append(g)
        if unscaled:  # already divided by the scale: check only
            one = torch.ones((), dtype=torch.float32, device=scaler.scale.device)
            return unscale_and_check_(grads, one)
        used, self._pending.scale_used = self._pending.scale_used, None
        factor = 1.0 if self.loss_scale_factor is None else float(self.loss_scale_factor)
        if scaler.fixed_at_one and factor == 1.0:
            # Check only: the masters' gradients are exact copies of the model's (bfloat16
            # O2, unscaled), so either holds this step's infs and NaNs.
            grads = self._master.gradients_to_check()
        return scaler.unscale_(grads, factor, scale=used)

    def _prepare(self, params: list[torch.Tensor], fused: bool = False) -> torch.Tensor | None:
        """This step's verdict: unscale and check (unless :meth:`unscale_` did), add to
        the accumulation window, agree with the other ranks; ``None`` while the window
        is not full."""
        found_inf, self._pending.unscaled_found_inf = self._pending.unscaled_found_inf, None
        if found_inf is None:
            found_inf = self._unscale(params, False, fused)
        else:  # unscale_() showed the masters in the model
            self._master.restore_model()  # the gradients as the user left them
        if self._accumulator is not None:
            found_inf = self._accumulator.window(params, found_inf)
            if found_inf is None:
                return None
        if dist.is_available() and dist.is_initialized():  # all ranks' verdict, before
            found_inf = agree_on_found_inf(found_inf, self.process_group)  # anything applies
        return found_inf

    def _fuses(self, step_kwargs: dict[str, Any] | None) -> bool:
        """Whether this step is the masters' fused one: no float32 master gradient is
        needed in memory (see ``MasterWeights.fused``) and nothing must see the
        gradients unscaled before it: no step arguments, no :meth:`unscale_` before,
        no accumulation or clipping, a scale fixed at 1."""
        return (
            not step_kwargs
            and self._pending.unscaled_found_inf is None
            and self._accumulator is None
            and (self.clipvalue, self.clipnorm, self.global_clipnorm) == (None, None, None)
            and self.loss_scaler.fixed_at_one
            and (self.loss_scale_factor is None or float(self.loss_scale_factor) == 1.0)
            and self._master.fuses()
        )

    def _checks_in_step(self) -> bool:
        """Whether a fused step checks the gradients itself, in its compiled graph, on a
        CPU (:func:`~mixprec.numerics.cpu_shortcuts`): a reduction per gradient before
        anything is written, about 200 us less a step than a check apart from it for a
        31-tensor model. It skips on a non-finite gradient, so it must skip
        (``skip_nonfinite``) and hear no other rank's verdict first. A GPU keeps the
        check apart (about six launches; the graph's reductions would be as many
        launches as its loops)."""
        return (
            self.skip_nonfinite
            and cpu_shortcuts(self.loss_scaler.device)
            and reduction_group(self.process_group) is None
        )

    def _apply(
        self,
        params: list[torch.Tensor],
        found_inf: torch.Tensor | None,
        step_kwargs: dict[str, Any] | None = None,
        fused: bool = False,
    ) -> tuple[bool, torch.Tensor]:
        """Clip, step (or skip; decay included), EMA, copy back, count; leave the scale
        alone. Returns (whether the step is known on the host to have been skipped, the
        verdict it went by). ``found_inf`` is ``None`` only for a ``fused`` step that
        checks the gradients itself (:meth:`_checks_in_step`): nothing is clipped then,
        and the step's own verdict is counted."""
        if found_inf is not None:
            if not self.skip_nonfinite:
                found_inf = torch.zeros_like(found_inf)
            if (self.clipvalue, self.clipnorm, self.global_clipnorm) != (None, None, None):
                with torch.no_grad():
                    self._clip(params)  # norms are the whole model's, across shards
        # 1 on an applied step, 0 on a skipped one: decay and EMA multiply by it.
        applied = (1.0 - found_inf if found_inf is not None
                   and (self.decoupled_weight_decay or self._ema) else None)  # fmt: skip
        skipped, verdict = self._master.step(
            found_inf, skip=self.skip_nonfinite, weight_decay=self.decoupled_weight_decay,
            applied=applied, step_kwargs=step_kwargs, fused=fused,
        )  # fmt: skip
        if found_inf is None:  # the fused step's own verdict (none: no gradients)
            found_inf = (verdict if verdict is not None else
                         torch.zeros((), dtype=torch.float32, device=self.loss_scaler.device))  # fmt: skip
            applied = 1.0 - found_inf if self._ema is not None else None
        if self._ema is not None and applied is not None:
            self._ema.update(params, applied, self._counters.applied.to(applied.device))
        if not fused:
            self._master.masters_to_model()
        self._counters.record(found_inf)
        return skipped, found_inf

    def _clip(self, params: list[torch.Tensor]) -> None:
        """Clip the gradients of the stepped ``params`` by the options set. FSDP1 flat
        shards (slices of many tensors) count in the global norm over the process group."""
        flat = {id(p) for p, m in zip(params, self.model_params()) if is_flat_shard(m)}
        grads = [p.grad for p in params if p.grad is not None and id(p) not in flat]
        shards = [p.grad for p in params if p.grad is not None and id(p) in flat]
        if shards and self.clipnorm is not None:  # a group added after construction
            _refuse_clipnorm_on_flat_shards(self.clipnorm)
        clip_gradients_(
            grads, self.clipvalue, self.clipnorm, self.global_clipnorm,
            shards=shards, process_group=self.process_group,
        )  # fmt: skip

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` did), check, clip, apply or skip, update the scale.

        ``closure``, if given, runs first (gradients enabled) and must call
        ``self.scale_loss(loss).backward()``. Other keyword arguments go to the inner
        optimizer's ``step`` (trainers such as Lightning forward theirs). Gradients that
        no :meth:`scale_loss` produced raise ``RuntimeError``; a collapsed dynamic scale
        raises :class:`~mixprec.ScaleCollapseError` (checked after skipped non-fused
        steps; fused loops call ``opt.loss_scaler.raise_if_collapsed()`` where they sync
        anyway).

        The pipeline, in order: the verdict (:meth:`_prepare`: unscale and check,
        accumulate, ranks agree) → :meth:`_apply` (clip, the masters' step or skip, EMA,
        copy back, count) → the scale's update (:meth:`LossScale.update_after
        <mixprec.loss_scale.LossScale.update_after>`). The masters' step is their fused
        one when nothing needs float32 master gradients in memory (:meth:`_fuses`).
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        scaler, params = self.loss_scaler, [p for g in self._inner.param_groups for p in g["params"]]
        fused = self._fuses(kwargs)
        if fused and self._checks_in_step():  # what _unscale does, but the check
            if not scaler.take_scaled(self):
                refuse_unscaled_gradients(scaler, self._inner.param_groups)
            self._pending.scale_used = None  # (1, as the scale is fixed at one)
            skipped, found_inf = self._apply(params, None, kwargs, fused)
        else:
            window = self._prepare(params, fused)
            if window is None:  # inside an accumulation window: nothing changes yet
                return result
            skipped, found_inf = self._apply(params, window, kwargs, fused)
        scaler.update_after(self, found_inf, skipped)  # may raise ScaleCollapseError
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients. After :meth:`unscale_` without :meth:`step`, this drops
        the step: ``torch.nn.utils.clip_grad_norm_`` showed a norm the loop will not
        step on (a spike), so it clears the gradients and goes on to the next batch.
        The loss scale then takes the dropped step's verdict, as ``GradScaler.update()``
        after ``unscale_()`` does (an overflow backs it off, so a loop that drops every
        non-finite step does not overflow forever); the step counters do not count it.
        Under data parallelism every rank must drop the step (its verdict is agreed)."""
        if self._pending.unscaled_found_inf is not None:
            found_inf, self._pending.unscaled_found_inf = self._pending.unscaled_found_inf, None
            self.loss_scaler.update_after(self, agree_on_found_inf(found_inf, self.process_group))
        self._master.zero_grad(set_to_none)
        self._inner.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # .get: torch's constructor calls this before the parts below exist.
        if getattr(self, "_master", None) is not None:
            param_group = self._master.add_param_group(self._checked_group(param_group))
        super().add_param_group(param_group)
        if (ema := getattr(self, "_ema", None)) is not None:
            self._ema = ParameterEMA(self._stepped_params(), ema.momentum, ema.overwrite_frequency)

    def _checked_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """``param_group`` with its params as a list, refused as torch's optimizers refuse
        a group, before master weights take it on: the inner optimizer sees masters (new
        tensors) and lean runs (views), so it could no longer tell a repeated parameter,
        and a generator of parameters would be used up before it saw them."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(
                f"param_group has no 'params' entry (it has {sorted(param_group)}); pass "
                "{'params': module.parameters(), ...}"
            )
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError(
                "param_group['params'] is a set, whose order changes between runs; pass "
                "a list of parameters"
            )
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"param_group['params'] holds a {type(p).__name__}; the optimizer can "
                    "only step tensors (pass module.parameters())"
                )
            if not p.is_leaf:
                raise ValueError(
                    "param_group['params'] holds a non-leaf tensor (the result of an op); "
                    "pass the parameters themselves"
                )
        known = {id(p) for p in self.model_params()}
        if len({id(p) for p in params}) < len(params) or any(id(p) in known for p in params):
            raise ValueError(
                "param_group['params'] repeats a parameter, or holds one the optimizer "
                "already steps; a parameter can be in one group only, once"
            )
        return {**param_group, "params": params}

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters (not their float32 masters), in group order."""
        return self._master.model_params

    def copy_ema_to_params(self) -> None:
        """Overwrite the parameters with their moving averages (needs ``use_ema=True``)."""
        if self._ema is None:
            raise ValueError("copy_ema_to_params() needs use_ema=True on this optimizer")
        self._ema.copy_into(self._stepped_params())
        self._master.masters_to_model()

    # -- gradient accumulation under DDP / FSDP2 ----------------------------------------

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
        accumulator = self._accumulator
        if accumulator is None or accumulator.steps < 2:
            raise ValueError(
                "no_sync() is for gradient accumulation: build the optimizer with "
                "gradient_accumulation_steps=N (N >= 2), or call model.no_sync() yourself "
                "around backward passes whose gradients you sum in .grad"
            )
        last = accumulator.micro_step + 1 >= accumulator.steps
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield from self._ddp_micro_step(model, last)
        elif callable(sync := getattr(model, "set_requires_gradient_sync", None)):  # FSDP2
            sync(last)
            try:
                yield
            finally:
                sync(True)
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

    def _ddp_micro_step(
        self, model: torch.nn.parallel.DistributedDataParallel, last: bool
    ) -> Iterator[None]:
        params = [p for p in model.parameters() if p.requires_grad]
        held, self._held_grads = self._held_grads, {}
        with torch.no_grad():
            for p in params:  # the window so far, summed in .grad by this backward
                if id(p) in held:
                    p.grad = held[id(p)] if p.grad is None else p.grad.add_(held[id(p)])
        if last:
            yield  # synchronised: DDP averages the window's sum over the ranks
            return
        with model.no_sync():
            yield
        self._held_grads = {id(p): p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = None

    # -- checkpoints (see the module docstring) ------------------------------------------

    _PARTS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("master", "_master"), ("ema", "_ema"), ("accumulation", "_accumulator"),
    )  # fmt: skip
    #: Each part as a refused load names it: what it is, and the option that makes it.
    _PART_OPTIONS: ClassVar[dict[str, tuple[str, str]]] = {
        "master": ("master weights", "master_weights (amp levels O2 and lean have them)"),
        "ema": ("moving averages of the parameters", "use_ema"),
        "accumulation": ("gradient accumulation", "gradient_accumulation_steps"),
    }

    def _part(self, attr: str) -> Any:
        """The optional part at ``attr``, or ``None`` where there is none (masters that
        keep nothing, as with ``master_weights=False``, count as none)."""
        part = getattr(self, attr)
        return None if part is None or getattr(part, "stateful", True) is False else part

    def _own_state_dict(self) -> dict[str, Any]:
        if self._held_grads:
            raise RuntimeError(
                "state_dict() inside a no_sync() accumulation window: the window's "
                "gradients are not part of any state dict; save after the step() that "
                "ends the window"
            )
        own: dict[str, Any] = {
            "loss_scale": loss_scale_state(self.loss_scaler),
            "counters": self._counters.state_dict(),
        }
        for key, attr in self._PARTS:
            part = self._part(attr)
            own[key] = None if part is None else part.state_dict()
        return {**self._inner.state_dict(), "mixprec": own}

    def _load_own_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner, own = _split_state_dict(state_dict)
        if own is not None:  # everything is checked before anything changes
            checked_loss_scale(self.loss_scaler, own["loss_scale"])
            for key, attr in self._PARTS:
                part = self._part(attr)
                if (own[key] is None) != (part is None):
                    what, option = self._PART_OPTIONS[key]
                    raise ValueError(
                        f"the checkpoint was saved {'without' if own[key] is None else 'with'} "
                        f"{what}, this optimizer {'has them' if part else 'has none'}; build "
                        f"it with the checkpoint's {option}"
                    )
                if part is not None:
                    _check_same_layout(part.state_dict(), own[key], f"state_dict['mixprec'][{key!r}]")
            StepCounters.check_state(own["counters"])
        self._inner.load_state_dict(inner)
        self._held_grads.clear()  # a loaded state starts its own window
        if own is None:
            return
        restore_loss_scale(self.loss_scaler, own["loss_scale"])
        self._counters.load_state_dict(own["counters"])
        for key, attr in self._PARTS:
            part = self._part(attr)
            if part is not None:
                part.load_state_dict(own[key])


def joint_step(*optimizers: LossScaleOptimizer) -> None:
    """Step several optimizers that share one loss scale as one: skip all or none.

    For optimizers whose parameters must move together (one model split over two
    optimizers, say ``SparseAdam`` for its embeddings and ``AdamW`` for the rest).
    Calling each ``opt.step()`` instead skips only the overflowing optimizer's step, as
    ``torch.amp.GradScaler`` does. Here every optimizer's gradients are unscaled and
    checked first; if any overflowed, all steps are skipped; then the shared scale is
    updated once.

    >>> w1, w2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    >>> from mixprec.loss_scale import DynamicLossScale
    >>> shared = DynamicLossScale(initial_scale=4.0)
    >>> a = LossScaleOptimizer(torch.optim.SGD([w1], lr=0.1), shared)
    >>> b = LossScaleOptimizer(torch.optim.SGD([w2], lr=0.1), shared)
    >>> a.scale_loss(w1.sum()).backward(); b.scale_loss(w2.sum() * float("inf")).backward()
    >>> joint_step(a, b)
    >>> float(w1.detach()), float(shared.scale)  # b overflowed: both skipped, scale halved
    (1.0, 2.0)
    """
    if not optimizers or not all(isinstance(o, LossScaleOptimizer) for o in optimizers):
        raise TypeError("joint_step takes one or more LossScaleOptimizer objects")
    if len({id(o.loss_scaler) for o in optimizers}) != 1:
        raise ValueError(
            "joint_step needs optimizers that share one loss scale "
            "(build them with loss_scale=<the same LossScale object>)"
        )
    if any(o.gradient_accumulation_steps for o in optimizers):
        raise ValueError("joint_step does not combine with gradient_accumulation_steps")
    params = [o._stepped_params() for o in optimizers]
    # _prepare gives None only inside an accumulation window, refused above.
    flags = [f for o, p in zip(optimizers, params) if (f := o._prepare(p)) is not None]
    found_inf = torch.stack([f.to(flags[0].device) for f in flags]).amax()
    for o, p in zip(optimizers, params):
        o._apply(p, found_inf)
    for o in optimizers:
        o.loss_scaler.update_after(o, found_inf)



def _split_state_dict(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the inner optimizer's state dict, mixprec's entry or ``None``), checked."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            "not an optimizer state dict: expected the keys 'state' and 'param_groups' "
            f"(and 'mixprec' from a LossScaleOptimizer), got {got}"
        )
    inner = {k: v for k, v in state_dict.items() if k != "mixprec"}
    own = state_dict.get("mixprec")
    keys = {"loss_scale", "counters", *(key for key, _ in LossScaleOptimizer._PARTS)}
    if own is not None and (not isinstance(own, dict) or set(own) != keys):
        got = sorted(own) if isinstance(own, dict) else type(own).__name__
        raise ValueError(f"state_dict['mixprec'] must have keys {sorted(keys)}, got {got}")
    return inner, own


def _check_same_layout(current: Any, saved: Any, where: str) -> None:
    """Raise ``ValueError`` unless ``saved`` fits ``current``: the same list lengths and
    tensor shapes under the keys both have (what a load needs to succeed), checked
    before anything loads."""
    if isinstance(current, dict):
        # Keys are the part's own business (it refuses another mode by name); the
        # tensors under the keys both sides have must fit.
        if isinstance(saved, dict):
            for key in current.keys() & saved.keys():
                _check_same_layout(current[key], saved[key], f"{where}[{key!r}]")
    elif isinstance(current, (list, tuple)) and current:  # empty: created on first use
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            got = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(
                f"{where} holds {got} entries where this optimizer has {len(current)}: "
                "was it saved from another model or optimizer?"
            )
        for i, (c, s) in enumerate(zip(current, saved)):
            _check_same_layout(c, s, f"{where}[{i}]")
    elif isinstance(current, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != current.shape:
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(
                f"{where} has shape {shape} where this optimizer has {tuple(current.shape)}: "
                "was it saved from another model?"
            )
