"""``OptimizerWrapper``: a real ``torch.optim.Optimizer`` that stands in front of another.

The wrapper is built through ``torch.optim.Optimizer.__init__`` (so its step and
state-dict hooks, profiling name and ``_patch_step_function`` are torch's own), and
from then on its ``param_groups``, ``state`` and ``defaults`` *are* the inner
optimizer's: LR schedulers, ``clip_grad_norm_`` over ``param_groups`` and anything
else that reads optimizer state see one set of groups.

Hyperparameters of the inner optimizer (the names in its ``defaults``: ``lr``,
``momentum``, ``betas`` ...) read from its first group and write to all its groups,
so ``wrapper.lr = 0.1`` works as on the inner optimizer.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2))
>>> opt = OptimizerWrapper(torch.optim.SGD([w], lr=0.5, momentum=0.9))
>>> opt.lr, opt.param_groups is opt.inner_optimizer.param_groups
(0.5, True)
>>> opt.momentum = 0.8; opt.inner_optimizer.param_groups[0]["momentum"]
0.8
>>> isinstance(opt, torch.optim.Optimizer)
True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerWrapper", "creates_state", "step_or_skip"]


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
    """An optimizer whose groups, state and hyperparameters are ``inner``'s."""

    param_groups = _FromInner()  # type: ignore[assignment]
    state = _FromInner()  # type: ignore[assignment]
    defaults = _FromInner()  # type: ignore[assignment]

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
        if (
            self._is_hyperparameter(name)
            and name not in self.__dict__
            and not hasattr(type(self), name)
        ):
            for group in self._inner.param_groups:
                group[name] = value
        else:
            object.__setattr__(self, name, value)

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


def creates_state(inner: torch.optim.Optimizer) -> bool:
    """Whether a step would create optimizer state (a parameter with a gradient and none)."""
    params = [p for g in inner.param_groups for p in g["params"]]
    if len(inner.state) >= len(params):
        return False
    return any(p.grad is not None and not inner.state.get(p) for p in params)


def step_or_skip(inner: torch.optim.Optimizer, found_inf: torch.Tensor, skip: bool = True) -> bool:
    """Step ``inner`` unless ``skip`` and ``found_inf`` (a 0/1 float tensor) is 1.

    Fused optimizers (``_step_supports_amp_scaling``) take the flag and skip on the
    device: no host sync. Any other optimizer costs one ``found_inf.item()``, and so
    does a fused step that would create state (a first step): fused kernels that skip
    still leave the state they allocate behind (SGD's momentum buffers uninitialised,
    Adam's moments at zero), and a skipped step must leave the state as it was.
    Returns ``True`` where the host saw the step skipped (the flag was read).
    """
    fused = getattr(inner, "_step_supports_amp_scaling", False)
    if fused and not (skip and creates_state(inner)):
        inner.found_inf = found_inf
        inner.grad_scale = None
        try:
            inner.step()
        finally:
            del inner.found_inf
            del inner.grad_scale
        return False
    if not skip:
        inner.step()
        return False
    if found_inf.item():  # the one host sync of a non-fused step
        return True
    inner.step()
    return False
