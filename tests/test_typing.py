"""The public API's types: mixprec.typing's aliases name exactly what the run-time checks
accept, and mypy accepts the right uses of the API and rejects the wrong ones."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Literal, get_args, get_origin

import pytest
from torch import nn

from mixprec import amp
from mixprec import typing as mt
from mixprec.amp import LEVELS
from mixprec.float8 import Float8Linear
from mixprec.optim.masters import MASTER_WEIGHT_MODES

ROOT = pathlib.Path(__file__).resolve().parents[1]
USAGE = ROOT / "tests" / "typing" / "api_usage.py"


def literals(alias: object) -> set[object]:
    """The literal values an alias admits (its Literal parts, through unions)."""
    if get_origin(alias) is Literal:
        return set(get_args(alias))
    return {value for arg in get_args(alias) for value in literals(arg)}


def low_precision_names(names: list[str]) -> set[str]:
    """The names ``amp.initialize`` takes as a level's low precision."""
    taken = set()
    for name in names:
        try:
            amp.initialize(nn.Linear(1, 1), level="O2", dtype=name)
        except ValueError:
            continue
        taken.add(name)
    return taken


def test_the_aliases_name_what_the_run_time_checks_accept():
    assert get_args(mt.Level) == LEVELS
    assert literals(mt.ModelLevel) == {*LEVELS, "rewrite"}
    # A dtype argument that takes any floating dtype lists every spelling when it refuses one.
    with pytest.raises(ValueError, match="accepted spellings: ") as refused:
        Float8Linear(2, 2, output_dtype="nonsense")
    names = str(refused.value).split("accepted spellings: ")[1].split(", ")
    assert literals(mt.DTypeName) == set(names)
    assert literals(mt.LowPrecision) == low_precision_names(names)
    assert literals(mt.MasterWeights) == {m for m in MASTER_WEIGHT_MODES if m}
    with pytest.raises(ValueError, match="fp8 must be one of ") as refused:
        amp.initialize(nn.Linear(1, 1), level="O0", fp8="bogus")
    recipes = re.findall(r"'(\w+)'", str(refused.value).split(", got ")[0])
    float8_recipes = {"dynamic", "delayed", "rowwise", "rowwise_with_gw_hp"}
    assert literals(mt.Float8Recipe) == set(recipes) == float8_recipes
    assert literals(mt.LossScaleSpec) == {"dynamic", "none"}


def test_import_mixprec_typing_imports_nothing_heavy():
    code = (
        "import sys, mixprec.typing\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'mixprec.'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "['mixprec.typing']"


def mypy(*files: pathlib.Path | str) -> subprocess.CompletedProcess[str]:
    """``python -m mypy FILES`` with the project's configuration (pyproject.toml)."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    return subprocess.run(
        [sys.executable, "-m", "mypy", *map(str, files)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_mypy_accepts_the_right_uses_and_rejects_the_wrong_ones_in_api_usage():
    done = mypy(USAGE.relative_to(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout


def test_mypy_rejects_a_wrong_level_and_reports_an_ignore_that_hides_nothing(tmp_path):
    (tmp_path / "wrong_level.py").write_text(textwrap.dedent("""\
        import torch
        from mixprec import amp

        net = torch.nn.Linear(2, 2)
        amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O7")
        """))  # fmt: skip
    # What api_usage.py relies on: an ignore on a call mypy accepts is itself an error.
    (tmp_path / "needless_ignore.py").write_text(textwrap.dedent("""\
        from mixprec.loss_scale import loss_scale_from_spec

        loss_scale_from_spec("dynamic")  # type: ignore[arg-type]
        """))  # fmt: skip
    done = mypy(tmp_path / "wrong_level.py", tmp_path / "needless_ignore.py")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    wrong = [line for line in errors if "wrong_level.py:5:" in line]
    assert len(wrong) == 1 and ("O7" in wrong[0] or "Literal" in wrong[0]), done.stdout
    assert "[arg-type]" in wrong[0]
    needless = [line for line in errors if "needless_ignore.py:3:" in line]
    assert len(needless) == 1 and "unused-ignore" in needless[0], done.stdout
    assert len(errors) == 2, done.stdout
