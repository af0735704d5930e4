"""Old import paths of this release's moved names and modules: they still work, with a
``DeprecationWarning`` that names the new path. They go in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "moved_name", "install_module_aliases"]

#: Old module path -> new module path.
MOVED_MODULES = {
    "mixprec.callbacks": "mixprec.train.callbacks",
    "mixprec.data": "mixprec.train.data",
    "mixprec.models": "mixprec.train.models",
    "mixprec.metrics": "mixprec.train.metrics",
    "mixprec.plots": "mixprec.train.plots",
    "mixprec.syncs": "mixprec.tools.syncs",
    "mixprec.memory": "mixprec.tools.memory",
    "mixprec.managers": "mixprec.compat.mindspore.managers",
    "mixprec.amp.train_step": "mixprec.compat.mindspore.cells",
}

_CALLBACKS = (
    "Callback CallbackList CSVLogger EarlyStopping History LossMonitor LossScaleMonitor "
    "LRScheduler ModelCheckpoint ProgressBar RunState"
)
_DATA = "DataError DataFileNotFoundError load_csv load_digits load_npz make_loaders train_test_loaders"
_MODULES_OF_NAMES = {
    "mixprec.train.callbacks": _CALLBACKS,
    "mixprec.train.data": _DATA,
    "mixprec.train.metrics": "Accuracy Loss Metric TopKAccuracy build_metric",
    "mixprec.train.models": "MLP MODEL_NAMES LeNet5 TransformerClassifier build_model",
    "mixprec.compat.mindspore": "DynamicLossScaleManager FixedLossScaleManager LossScaleManager "
    "build_train_network",
    "mixprec.compat.tf": "enable_mixed_precision_graph_rewrite",
    "mixprec.rewrite": "AmpLists CaptureError RewriteReport",
    "mixprec.amp": "set_policy to_float",
    "mixprec.tools": "HostSyncCounter",
}
#: Name once exported by ``mixprec`` -> the module that exports it now.
MOVED_NAMES = {
    name: module for module, names in _MODULES_OF_NAMES.items() for name in names.split()
}


def moved_name(name: str) -> Any:
    """The object once exported as ``mixprec.<name>``, with a ``DeprecationWarning``."""
    module = MOVED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    warnings.warn(
        f"mixprec.{name} moved: import it from {module}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), name)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as its new module, with a ``DeprecationWarning``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed."""


def install_module_aliases() -> None:
    """Put the finder for the old module paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
