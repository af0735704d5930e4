"""``MixprecPrecision``: a Lightning ``Precision`` plugin that trains at a mixprec amp level.

::

    trainer = lightning.Trainer(
        plugins=[MixprecPrecision(level="O2", dtype=torch.bfloat16)], gradient_clip_val=1.0
    )

What it does, at the points where Lightning calls a precision plugin::

    convert_module(module)    amp.initialize(module, None, level, dtype)   # before DDP wraps it
    connect(optimizers)       each -> LossScaleOptimizer(opt, one shared loss scale,
                                                         master_weights)
    pre_backward(loss)        loss * scale
    optimizer_step(opt)       closure (forward + backward)
                              -> opt.unscale_()                            # true gradients
                              -> on_before_optimizer_step hooks, gradient clipping
                              -> opt.step()          # skipped if a gradient is inf/NaN
                              -> log mixprec/loss_scale, mixprec/skipped_steps
    state_dict()              level and dtype; the loss scale, counters and float32
                              masters are in each optimizer's state in the same checkpoint

The level casts the LightningModule's floating outputs to float32 when they leave its
``forward``, as :func:`mixprec.amp.initialize` does for any model: call the network as
``self(x)`` in ``training_step`` and the loss is computed in float32 (a submodule
called directly returns float32 at O1, its low-precision output at O2/O3).
Manual optimization works the same way: ``self.manual_backward(loss)`` scales,
``self.clip_gradients(opt, ...)`` unscales first, ``opt.step()`` skips on overflow.
``accumulate_grad_batches`` scales every micro-batch by the same scale (it only
changes at a step). Host syncs: those of :class:`~mixprec.LossScaleOptimizer`; the
logged values are tensors, read when Lightning writes its logs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mixprec import amp
from mixprec._checks import check_bool
from mixprec.amp._initialize import check_fp8
from mixprec.amp._level_specs import check_master_weights, spec_of
from mixprec.integrations._common import ScaleReader, check_level, level_loss_scale, require
from mixprec.optim import LossScaleOptimizer

if TYPE_CHECKING:
    from mixprec.typing import MasterWeights

require("lightning", "lightning", __name__)

from lightning.pytorch import LightningModule  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

__all__ = ["MixprecPrecision", "ScaleReader"]

#: The attribute that records, on a converted module, the plugin settings it got.
_CONVERTED = "_mixprec_lightning_precision"


def _lightning_name(level: str, dtype: torch.dtype) -> str:
    """Lightning's name for the precision a level gives (``trainer.precision``): ``-true``
    where every parameter is stored low, ``-mixed`` where some stay float32."""
    spec = spec_of(level)
    if not spec.low_precision:
        return "32-true"
    low = "bf16" if dtype == torch.bfloat16 else "16"
    return f"{low}-true" if spec.storage == "low" else f"{low}-mixed"


class MixprecPrecision(Precision):
    """Train a LightningModule at a mixprec amp level, with mixprec's loss scaling.

    Args:
        level: ``"O0"``-``"O3"``, ``"lean"`` or ``"auto"`` (decided by ``device``), as in
            :func:`mixprec.amp.initialize`.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        loss_scale: ``None`` (the level's own: dynamic for float16 O1 and O2),
            ``"dynamic"``, a number, ``"none"`` or any :class:`~mixprec.LossScale`
            (e.g. ``DynamicLossScale(min_scale=..., hysteresis=2)``). Every optimizer
            shares it, as they share Lightning's one ``GradScaler``.
        device: where ``auto`` looks for fast low precision (default: CUDA if available).
        fp8: float8 linear layers, as ``amp.initialize(..., fp8=)``: ``True`` or
            ``"dynamic"``, ``"delayed"``, or ``False`` (default).
        log_metrics: log ``mixprec/loss_scale`` and ``mixprec/skipped_steps`` at every
            optimizer step through ``LightningModule.log`` (Lightning's loggers write
            them every ``log_every_n_steps``).
        master_weights: what each optimizer steps at O2, O3 and lean, as
            ``amp.initialize(..., master_weights=)``: ``None`` (default) the level's own,
            or ``"fp32"``, ``"split"``, ``"split8"``, ``"kahan"``, ``"stochastic"``, ``False``.

    Return the plain optimizer from ``configure_optimizers``; the plugin wraps it (a
    ``LossScaleOptimizer`` there is a ``TypeError``).

    >>> plugin = MixprecPrecision(level="O2", dtype=torch.bfloat16)
    >>> plugin.precision, plugin.loss_scale.kind
    ('bf16-mixed', 'none')
    >>> MixprecPrecision(level="O5")
    Traceback (most recent call last):
    ...
    ValueError: level must be one of O0, O1, O2, O3, lean, auto, got 'O5'
    """

    def __init__(
        self,
        level: str = "O2",
        dtype: torch.dtype = torch.bfloat16,
        loss_scale: Any = None,
        *,
        device: torch.device | str | None = None,
        fp8: bool | str = False,
        log_metrics: bool = True,
        master_weights: MasterWeights | None = None,
    ) -> None:
        check_bool("log_metrics", log_metrics)
        self.fp8 = check_fp8(fp8)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {device!r}")
        self.device = str(device)  # as Lightning's MixedPrecision has it
        self.level, self.dtype = check_level(level, dtype, device)
        self.loss_scale = level_loss_scale(loss_scale, self.level, self.dtype)
        self.master_weights = check_master_weights(master_weights, self.level, self.dtype)
        self.log_metrics = log_metrics
        self.precision = _lightning_name(self.level, self.dtype)  # type: ignore[assignment]
        self._converted: weakref.WeakSet = weakref.WeakSet()
        self._optimizers: list[LossScaleOptimizer] = []
        self._skipped_backward = False  # training_step returned None: nothing to unscale

    @property
    def scaler(self) -> ScaleReader | None:
        """What ``trainer.precision_plugin.scaler`` is to code written for Lightning's
        ``MixedPrecision``: ``None`` without loss scaling (bfloat16, as Lightning's), else
        a :class:`ScaleReader` of the shared scale (``get_scale()``, ``_scale``)."""
        return None if self.loss_scale.kind == "none" else ScaleReader(self.loss_scale)

    def __repr__(self) -> str:
        return (
            f"MixprecPrecision(level={self.level!r}, dtype={self.dtype}, "
            f"loss_scale={self.loss_scale!r}, master_weights={self.master_weights!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # Strategies that start processes (ddp_spawn) pickle the plugin. The weak set of
        # converted modules cannot be pickled and means nothing in another process: a
        # module converted here carries its mark (_CONVERTED) wherever it goes.
        state = dict(self.__dict__)
        state["_converted"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._converted = weakref.WeakSet()

    # -- the module and the optimizers --------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Apply the level to ``module`` in place, once: a later ``fit``/``test`` of this or
        another Trainer with the same level, dtype and fp8 reuses it (train, then test)."""
        if module in self._converted:
            return module
        done = getattr(module, _CONVERTED, None)
        mine = (self.level, str(self.dtype), self.fp8)
        if done is None:
            amp.initialize(module, None, self.level, self.dtype, fp8=self.fp8 or False)
            setattr(module, _CONVERTED, mine)
        elif done != mine:
            raise ValueError(
                f"this LightningModule was prepared by a MixprecPrecision at level {done[0]} in "
                f"{done[1]} with fp8={done[2]!r}; this plugin is level {self.level} in "
                f"{self.dtype} with fp8={self.fp8!r}. Use the same plugin settings, or a fresh "
                "module"
            )
        self._converted.add(module)
        return module

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Wrap each optimizer in a :class:`~mixprec.LossScaleOptimizer` sharing the loss scale.

        LR schedulers keep working: the wrapper's ``param_groups`` are the inner optimizer's.
        The wrappers this plugin made pass through unchanged: ``trainer.test`` or
        ``predict`` after ``fit`` connects the optimizers that ``fit`` left.
        """

        def is_mine(opt: Any) -> bool:
            return any(opt is own for own in self._optimizers)

        for i, opt in enumerate(optimizers):
            if is_mine(opt):
                continue
            if isinstance(opt, LossScaleOptimizer):
                raise TypeError(
                    f"configure_optimizers returned a LossScaleOptimizer (optimizer {i}); "
                    "return the plain optimizer: MixprecPrecision wraps it for level "
                    f"{self.level} (float32 masters at O2) with its loss scale"
                )
            if isinstance(opt, torch.optim.LBFGS):
                raise TypeError(
                    "MixprecPrecision cannot step LBFGS: its closure re-evaluates the loss "
                    "during the step, after the plugin has unscaled the gradients"
                )
        wrapped = [
            LossScaleOptimizer(opt, self.loss_scale, master_weights=self.master_weights)
            if any(g["params"] for g in opt.param_groups) and not is_mine(opt)
            else opt  # this plugin's already, or Lightning's placeholder (no optimizer)
            for opt in optimizers
        ]
        self._optimizers = [o for o in wrapped if isinstance(o, LossScaleOptimizer)]
        for opt in self._optimizers:
            if opt.unscaled:  # a run that stopped between unscaling and its step
                opt.zero_grad()  # drops that step: the next one unscales its own
        return model, wrapped, lr_schedulers

    def _own(self, optimizer: Any) -> LossScaleOptimizer | None:
        """The plugin's wrapper behind ``optimizer`` (a LightningOptimizer or the wrapper)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return next((o for o in self._optimizers if o is optimizer), None)

    def _unscale_once(self, opt: LossScaleOptimizer) -> None:
        if not opt.unscaled:
            opt.unscale_()

    # -- one training step ---------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: LightningModule) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss. Every wrapper records the scale (they share it), so whichever
        optimizer steps first and backs the scale off, the others still unscale right."""
        scaled = tensor
        for opt in self._optimizers:
            scaled = opt.scale_loss(tensor)
        return super().pre_backward(scaled, module)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the loss scale now (once per step)."""
        opt = self._own(optimizer)
        if opt is not None:
            self._unscale_once(opt)

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Unscale (once), then clip the true gradients (the float32 masters' at O2).

        A fused optimizer the plugin did not wrap is refused while losses are scaled, as
        Lightning's ``MixedPrecision`` refuses it: its gradients are still scaled, and only
        its own step would divide them, after the clipping.
        """
        opt = self._own(optimizer)
        if opt is not None and clip_val > 0 and not self._skipped_backward:
            self._unscale_once(opt)
        if (
            opt is None
            and clip_val > 0
            and self.loss_scale.needs_scaled_loss
            and getattr(optimizer, "_step_supports_amp_scaling", False)
        ):
            raise RuntimeError(
                f"The current optimizer, {type(optimizer).__qualname__}, does not allow for "
                "gradient clipping here: MixprecPrecision did not wrap it, so its gradients "
                "are still multiplied by the loss scale and its fused step divides them only "
                "after the clipping. Return it from configure_optimizers: the plugin wraps "
                "it and unscales its gradients before they are clipped"
            )
        super().clip_gradients(opt or optimizer, clip_val, gradient_clip_algorithm)

    def autocast_context_manager(self) -> torch.autocast:
        """``torch.autocast`` to the plugin's dtype on its device, without the autocast
        cache, as Lightning's ``MixedPrecision`` gives it: for computations outside the
        LightningModule's forward, which the level already casts. Disabled at O0.

        >>> with MixprecPrecision("O1", torch.bfloat16, device="cpu").autocast_context_manager():
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.bfloat16
        """
        return torch.autocast(
            torch.device(self.device).type,
            dtype=self.dtype,
            enabled=spec_of(self.level).low_precision,
            cache_enabled=False,
        )

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        opt = self._own(optimizer)
        if opt is None:
            self._refuse_scaled_step(optimizer)
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # training_step returned None: Lightning skipped the backward, there is nothing to step.
        no_backward = closure_result is None and model.automatic_optimization
        if not no_backward:
            self._unscale_once(opt)  # before the hooks and clipping, which want true gradients
        self._skipped_backward = no_backward  # clipping then has no gradients to unscale
        try:
            self._after_closure(model, optimizer)
        finally:
            self._skipped_backward = False
        if no_backward:
            return closure_result
        output = opt.step(**kwargs)
        if self.log_metrics:
            self._log(model, opt)
        return output

    def _refuse_scaled_step(self, optimizer: Any) -> None:
        """Raise before anything runs if ``optimizer`` (not wrapped by this plugin) would
        step on gradients multiplied by the loss scale: the losses are scaled for this
        plugin's optimizers, and backward scales every parameter's gradient alike."""
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        holds_params = any(g["params"] for g in getattr(inner, "param_groups", ()))
        if self._optimizers and self.loss_scale.needs_scaled_loss and holds_params:
            raise RuntimeError(
                f"MixprecPrecision did not wrap this {type(inner).__qualname__}, but the "
                "losses are multiplied by the loss scale, so its step would use scaled "
                "gradients; return every optimizer from configure_optimizers (the plugin "
                "wraps each with the shared loss scale)"
            )

    def _log(self, model: LightningModule, opt: LossScaleOptimizer) -> None:
        suffix = "" if len(self._optimizers) == 1 else f"_{self._optimizers.index(opt)}"
        options = {"on_step": True, "on_epoch": False, "batch_size": 1}
        # Copies: the scale tensor is updated in place at the next step.
        model.log("mixprec/loss_scale", opt.loss_scale.detach().clone(), **options)
        model.log(f"mixprec/skipped_steps{suffix}", opt.skipped_steps.float(), **options)

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Level, dtype and float8 recipe, checked on resume (the loss scale is in the
        optimizer states, the float8 scaling state in the model's)."""
        return {"level": self.level, "dtype": str(self.dtype), "fp8": self.fp8}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("level"), state_dict.get("dtype"), state_dict.get("fp8"))
        if saved != (self.level, str(self.dtype), self.fp8):
            raise ValueError(
                f"the checkpoint was trained with MixprecPrecision at level {saved[0]} in "
                f"{saved[1]} with fp8={saved[2]!r}; this plugin is level {self.level} in "
                f"{self.dtype} with fp8={self.fp8!r}. Resume with the same level, dtype and fp8 "
                "(the optimizer state holds float32 masters only at O2)"
            )
