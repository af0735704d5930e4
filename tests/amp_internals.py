"""What the tests read of the amp hooks' internals, in one place.

The public API cannot show these: the per-thread call state that a forward pass must
leave empty (however it ends: an exception, a graph break, a compiled frame), which
modules carry amp's hooks, the BatchNorm shortcut that takes a low-precision input as
it comes (compared with the casts it saves), and the CPU probe for float16 LSTMs under
``torch.autocast``. Tests that check these go through this module, so that moving the
internals changes this file alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn

from mixprec.amp import _cast_cache, _cast_hooks, _initialize


def call_state_left() -> dict[str, list]:
    """The per-thread call state of the amp hooks that is not empty: ``{}`` between calls.

    ``regions`` (dtypes of the module regions being run), ``functions`` (the lists of the
    active function-cast mode), ``autocast`` (O1's ``torch.autocast`` entries) and
    ``caches`` (cast caches holding casts of the pass)."""
    local = _cast_cache._local
    state = {
        "regions": local.stack,
        "functions": local.functions,
        "autocast": local.autocast,
        "caches": local.caches,
    }
    return {name: list(value) for name, value in state.items() if value}


def is_hooked(module: nn.Module) -> bool:
    """Whether amp put hooks of its own on ``module`` (O1 with the default lists hooks every
    module of its region, each of which opens the region when called with none open)."""
    return _cast_hooks.get_state(module) is not None


def calls_left(module: nn.Module) -> dict[int, list]:
    """What ``module``'s hooks still hold of calls in progress: ``{}`` between calls."""
    state = _cast_hooks.get_state(module)
    return {} if state is None else {**state._frames, **state._active}


@contextlib.contextmanager
def batchnorm_low_input(taken: bool) -> Iterator[None]:
    """Inside, a normalisation layer kept in float32 takes a low-precision input as it
    comes where it can (``taken=True``, what amp does) or, as before that shortcut, always
    has it cast up on entry and its output cast back down (``taken=False``)."""
    keep = _cast_hooks.ModuleAmp._takes_low_input if taken else (lambda *args: False)
    with mock.patch.object(_cast_hooks.ModuleAmp, "_takes_low_input", keep):
        yield


def cpu_autocast_runs_lstm(dtype: torch.dtype) -> bool:
    """The probe O1 asks (once per dtype) whether ``torch.autocast("cpu", dtype)`` can run
    an ``nn.LSTM`` on this CPU."""
    return _initialize._cpu_autocast_runs_lstm(dtype)


def forget_cpu_autocast_probe() -> None:
    """Drop the probe's cached answers, so that the next question runs it again."""
    _initialize._cpu_autocast_runs_lstm.cache_clear()


def pretend_cpu_autocast_cannot_run_lstm(monkeypatch) -> None:
    """Make O1 see this CPU as one whose ``torch.autocast`` cannot run an LSTM in float16."""
    monkeypatch.setattr(_initialize, "_cpu_autocast_runs_lstm", lambda dtype: False)
