"""The package layout: layers point down only, the core names no seed system, the old
import paths still work for this release with a DeprecationWarning."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import mixprec
from mixprec._moved import MOVED_MODULES, MOVED_NAMES

SRC = pathlib.Path(mixprec.__file__).parent
CORE = ["loss_scale", "numerics.py", "policy.py", "dtypes.py", "_checks.py", "optim", "amp",
        "rewrite", "diagnostics"]  # fmt: skip
SEED_WORDS = ("tensorflow", "keras", "mindspore", "manager", "sens")


def core_files():
    for entry in CORE:
        path = SRC / entry
        yield from (sorted(path.glob("*.py")) if path.is_dir() else [path])


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("path", list(core_files()), ids=lambda p: str(p.relative_to(SRC)))
def test_the_core_imports_nothing_above_it_and_names_no_seed_system(path):
    above = ("mixprec.compat", "mixprec.train", "mixprec.cli")
    assert not [m for m in imported_modules(path) if m.startswith(above)]
    text = path.read_text().lower()
    assert not [w for w in SEED_WORDS if f" {w}" in text or f"{w}." in text or f"{w}_" in text]


def test_no_module_is_over_400_lines_and_the_optimizer_is_at_most_300():
    sizes = {p: len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert max(sizes.values()) <= 400, max(sizes, key=sizes.get)
    assert sizes[SRC / "optim" / "loss_scale_optimizer.py"] <= 300


def test_the_top_level_exports_about_twenty_names():
    assert 15 <= len(mixprec.__all__) <= 25
    assert all(hasattr(mixprec, name) for name in mixprec.__all__)


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_old_top_level_names_warn_and_give_the_same_object(name):
    with pytest.warns(DeprecationWarning, match=f"mixprec.{name} moved"):
        old = getattr(mixprec, name)
    assert old is getattr(importlib.import_module(MOVED_NAMES[name]), name)


def test_old_module_paths_import_the_new_module_with_a_warning():
    # A fresh interpreter: the old names must not already sit in sys.modules.
    code = (
        "import importlib, warnings\n"
        f"for old, new in {sorted(MOVED_MODULES.items())!r}:\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new), (old, module)\n"
        "    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)\n"
        "               for w in caught), (old, [str(w.message) for w in caught])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = mixprec.nonsense
