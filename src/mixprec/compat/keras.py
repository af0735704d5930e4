"""Keras 3's mixed-precision names, over the mixprec core.

>>> import torch
>>> from mixprec.compat.keras import LossScaleOptimizer
>>> w = torch.zeros(3, requires_grad=True)
>>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), clipnorm=1.0, name="sgd_ls")
>>> opt.scale_loss((w - 5).square().sum()).backward(); opt.step()
>>> round(float(w.detach().norm()), 6)   # the unscaled gradient (norm 17.3) clipped to 1
0.1
>>> float(opt.dynamic_scale), opt.name
(32768.0, 'sgd_ls')
>>> config = opt.get_config()
>>> sorted(config)
['clipnorm', 'dynamic_growth_steps', 'initial_scale', 'inner_optimizer', 'name']
>>> LossScaleOptimizer.from_config(config, params=[w]).clipnorm
1.0
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mixprec._checks import check_bool, check_instance, check_number
from mixprec.compat._optimizer_config import optimizer_config
from mixprec.compat.tf._optimizer import TFOptimizerAPI, inner_from_config
from mixprec.loss_scale import DynamicLossScale
from mixprec.optim import LossScaleOptimizer as _CoreLossScaleOptimizer
from mixprec.policy import Policy, global_policy, policy_scope, set_global_policy

__all__ = [
    "LossScaleOptimizer",
    "Policy",
    "set_global_policy",
    "global_policy",
    "policy_scope",
    "BASE_OPTIMIZER_KWARGS",
]

#: The base-optimizer keyword arguments a Keras 3 optimizer takes (and this one accepts).
BASE_OPTIMIZER_KWARGS = (
    "name",
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)

# Their defaults: get_config() lists an option only where it differs (Keras 3 lists none).
_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


class LossScaleOptimizer(TFOptimizerAPI, _CoreLossScaleOptimizer):
    """``keras.optimizers.LossScaleOptimizer(inner_optimizer, initial_scale=32768.0,
    dynamic_growth_steps=2000, **kwargs)``.

    Keras 3's rule: on a non-finite gradient the scale is halved and the step skipped;
    after ``dynamic_growth_steps`` finite steps it is doubled. Keras 3 sets no floor and
    no ceiling, and neither does this. ``kwargs`` are the base-optimizer options
    (:data:`BASE_OPTIMIZER_KWARGS`), all applied to unscaled gradients and only on
    applied steps. ``dynamic_scale`` and ``step_counter`` are Keras's names for
    ``loss_scale`` and ``dynamic_counter``. ``dynamic=True`` is accepted and
    ``dynamic=False`` refused, as Keras 3 does.

    ``get_config()`` has Keras's keys (``name``, ``inner_optimizer`` nested as
    ``{"module", "class_name", "config"}``, ``initial_scale``, ``dynamic_growth_steps``)
    plus each base option set to other than its default; ``from_config(config,
    custom_objects=None, params=...)`` rebuilds it over ``params``
    (:mod:`mixprec.compat._optimizer_config`), or takes ``config["inner_optimizer"]``
    as an optimizer object.
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        initial_scale: float = 32768.0,
        dynamic_growth_steps: int = 2000,
        **kwargs: Any,
    ) -> None:
        dynamic = kwargs.pop("dynamic", True)
        check_bool("dynamic", dynamic)
        if not dynamic:
            raise ValueError(
                "LossScaleOptimizer no longer supports dynamic=False (Keras 3): set "
                "loss_scale_factor= for a fixed factor, or use "
                "mixprec.compat.tf.LossScaleOptimizer(opt, dynamic=False, initial_scale=...)"
            )
        unknown = sorted(set(kwargs) - set(BASE_OPTIMIZER_KWARGS))
        if unknown:
            raise TypeError(
                f"LossScaleOptimizer got unexpected keyword arguments {unknown}; "
                f"accepted: {', '.join(BASE_OPTIMIZER_KWARGS)}"
            )
        name = kwargs.pop("name", None)
        if name is not None:
            check_instance("name", name, str, "a str or None")
        check_number("initial_scale", initial_scale, minimum=0, exclusive=True)
        check_number("dynamic_growth_steps", dynamic_growth_steps, integer=True, minimum=1)
        loss_scale = DynamicLossScale(
            initial_scale=initial_scale,
            growth_interval=dynamic_growth_steps,
            min_scale=None,
            max_scale=None,
        )
        super().__init__(inner_optimizer, loss_scale, **kwargs)
        self.__dict__["name"] = name if name is not None else "loss_scale_optimizer"
        self.__dict__["_ema_options"] = (
            kwargs.get("ema_momentum", 0.99),
            kwargs.get("ema_overwrite_frequency"),
        )

    def get_config(self) -> dict[str, Any]:
        """Keras 3's keys, plus the base options that differ from their defaults."""
        ls = self.loss_scaler
        options = {name: getattr(self, name) for name in _BASE_DEFAULTS}  # current values
        return {
            "name": self.name,
            "inner_optimizer": optimizer_config(self.inner_optimizer),
            "initial_scale": float(ls.initial_scale),
            "dynamic_growth_steps": ls.growth_interval,
            **{k: v for k, v in options.items() if v != _BASE_DEFAULTS[k]},
        }

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        custom_objects: Mapping[str, Any] | None = None,
        *,
        params: Any = None,
    ) -> LossScaleOptimizer:
        """Rebuild from :meth:`get_config` over ``params`` (Keras: ``cls(inner, **config)``)."""
        config = dict(config)
        if "inner_optimizer" not in config:
            raise ValueError(f"config has no 'inner_optimizer' (keys: {sorted(config)})")
        inner = inner_from_config(config.pop("inner_optimizer"), params, custom_objects)
        return cls(inner, **config)

    # Keras's attribute names for the base-optimizer options. ``weight_decay`` is the
    # decoupled decay given here, not the inner optimizer's own ``weight_decay``
    # hyperparameter (the core stores this one as ``decoupled_weight_decay``).
    @property
    def weight_decay(self) -> float | None:
        """The decoupled weight decay passed as ``weight_decay=`` (``None``: none)."""
        return self.decoupled_weight_decay

    @weight_decay.setter
    def weight_decay(self, value: float | None) -> None:
        check_number("weight_decay", value, minimum=0, allow_none=True)
        self.__dict__["decoupled_weight_decay"] = value

    @property
    def ema_momentum(self) -> float:
        """The EMA momentum (Keras default 0.99; used only with ``use_ema=True``)."""
        return self._ema.momentum if self._ema is not None else self._ema_options[0]

    @property
    def ema_overwrite_frequency(self) -> int | None:
        """Applied steps between overwrites of the parameters by their averages."""
        return self._ema.overwrite_frequency if self._ema is not None else self._ema_options[1]

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, torch.Tensor]]) -> None:
        """Keras 3's ``apply_gradients``: the gradients of ``scale_loss(loss)``, still
        scaled; they are unscaled, checked, applied or skipped, and the scale updated.

        (TF 2's ``LossScaleOptimizer.apply_gradients``, in :mod:`mixprec.compat.tf`, takes
        gradients already unscaled with ``get_unscaled_gradients``.)
        """
        self._apply_pairs(grads_and_vars, scaled=True)

    def apply(
        self, grads: Iterable[Any], trainable_variables: Iterable[torch.Tensor] | None = None
    ) -> None:
        """Keras 3's ``apply(grads, trainable_variables=None)``: :meth:`apply_gradients`
        unzipped; without ``trainable_variables``, ``grads`` follow the optimizer's own
        parameters in order."""
        params = self.model_params() if trainable_variables is None else list(trainable_variables)
        grads = list(grads)
        if len(grads) != len(params):
            raise ValueError(f"got {len(grads)} gradients for {len(params)} variables")
        self.apply_gradients(list(zip(grads, params)))

    def scale_loss(self, loss: Any) -> torch.Tensor:
        """``loss * scale`` (and ``loss_scale_factor``); call ``.backward()`` on the result.

        A plain number gives the scaled number as a float32 tensor, as Keras's
        ``scale_loss(1.0)`` (its tests read the scale that way); that reads the scale and
        changes nothing: only a tensor loss counts as a scaled loss for :meth:`step`.

        >>> opt = LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]),
        ...                          initial_scale=400.0)
        >>> opt.scale_loss(1.0)
        tensor(400.)
        """
        if isinstance(loss, torch.Tensor):
            return super().scale_loss(loss)
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise TypeError(
                f"loss must be a tensor or a number, got {type(loss).__name__}; "
                "pass the loss tensor (e.g. opt.scale_loss(loss_fn(model(x), y)))"
            )
        # The arithmetic of the scaled loss, with a constant: nothing to differentiate.
        scale = self.loss_scaler.scale.detach() * self._factor()
        return torch.tensor(float(loss), dtype=torch.float32, device=scale.device) * scale

    @property
    def dynamic_scale(self) -> torch.Tensor:
        """The current loss scale (Keras's name)."""
        return self.loss_scale

    @property
    def step_counter(self) -> torch.Tensor:
        """Finite steps since the scale last changed (Keras's name)."""
        return self.dynamic_counter

    def finalize_variable_values(self) -> None:
        """Overwrite the parameters with their moving averages (needs ``use_ema=True``)."""
        if self._ema is None:
            raise ValueError("finalize_variable_values() needs use_ema=True on this optimizer")
        self.copy_ema_to_params()
