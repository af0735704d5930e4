"""The package layout: layers point down only, the core names no seed system, and
``import mixprec`` is cheap: the subpackages load on first use."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import mixprec

SRC = pathlib.Path(mixprec.__file__).parent
#: The core's modules and packages (each may be either, or merged into another).
CORE = ["loss_scale", "numerics", "policy", "_checks", "optim", "amp", "rewrite",
        "diagnostics"]  # fmt: skip
SEED_WORDS = ("tensorflow", "keras", "mindspore", "manager", "sens")


def core_files():
    for entry in CORE:
        package, module = SRC / entry, SRC / f"{entry}.py"
        if (package / "__init__.py").is_file():
            yield from sorted(package.glob("*.py"))
        elif module.is_file():
            yield module


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


def test_the_top_level_exports_about_twenty_names():
    assert 15 <= len(mixprec.__all__) <= 25
    assert all(hasattr(mixprec, name) for name in mixprec.__all__)


#: What ``import mixprec`` must leave unimported: each loads on first use.
HEAVY = ("mixprec.amp", "mixprec.train", "mixprec.diagnostics", "mixprec.float8",
         "mixprec.rewrite", "mixprec.integrations")  # fmt: skip


def test_import_mixprec_loads_no_heavy_subpackage():
    # A fresh interpreter: this one has imported them all already.
    code = (
        "import sys, mixprec\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


def test_the_exported_names_load_on_first_use():
    assert set(mixprec.__all__) <= set(dir(mixprec))
    assert mixprec.Model is importlib.import_module("mixprec.train").Model
    assert mixprec.diagnose is importlib.import_module("mixprec.diagnostics").diagnose
    assert mixprec.amp is importlib.import_module("mixprec.amp")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = mixprec.nonsense


# -- files per concept: what a reader follows ----------------------------------------------


def files_run_by(action) -> list[str]:
    """The mixprec source files whose functions run during ``action()`` (sys.setprofile)."""
    files: set[str] = set()

    def profile(frame, event, arg):
        code = frame.f_code  # module bodies run once, at import: not part of the action
        if event == "call" and code.co_name != "<module>" and code.co_filename.startswith(str(SRC)):
            files.add(str(pathlib.Path(frame.f_code.co_filename).relative_to(SRC)))

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return sorted(files)


def o2_model_and_optimizer():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def test_one_o2_step_the_skip_decision_and_a_resume_run_through_a_handful_of_files(
    record_property,
):
    import torch

    from mixprec.amp import initialize
    from mixprec.optim import LossScaleOptimizer

    net, inner = o2_model_and_optimizer()
    x = torch.randn(4, 8)
    state = {}

    state["net"], state["opt"] = initialize(net, inner, "O2", torch.bfloat16)

    def o2_step():
        loss = state["net"](x).float().square().mean()
        state["opt"].scale_loss(loss).backward()
        state["opt"].step()
        state["opt"].zero_grad()

    step_files = files_run_by(o2_step)
    opt = state["opt"]
    opt.scale_loss(state["net"](x).float().square().mean()).backward()
    saved = opt.state_dict()
    next(p for p in state["net"].parameters()).grad.fill_(float("inf"))
    skip_files = files_run_by(opt.step)
    assert int(opt.skipped_steps) == 1
    resume_files = files_run_by(lambda: opt.load_state_dict(saved))

    plain = torch.nn.Parameter(torch.ones(2))
    plain_opt = LossScaleOptimizer(torch.optim.SGD([plain], lr=0.1))
    plain_opt.scale_loss(plain.sum() * float("inf")).backward()
    plain_skip_files = files_run_by(plain_opt.step)

    for name, files in [("O2 step", step_files), ("skip decision (O2)", skip_files),
                        ("skip decision (no masters)", plain_skip_files),
                        ("optimizer resume", resume_files)]:  # fmt: skip
        record_property(name, ", ".join(files))  # in --junitxml's report
    # (O2's step asks optim/masters/_fused.py whether it is the compiled one)
    assert len(step_files) <= 9, step_files
    # (the scale, the check, the wrapper's pipeline and the mode that steps: _plain.py)
    assert len(plain_skip_files) <= 4, plain_skip_files
    assert len(skip_files) <= 5, skip_files  # the three, the master weights, the fused step
    assert len(resume_files) <= 8, resume_files


# -- import cycles, private modules, the optimizer core's seams ------------------------------


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports_of(module: str) -> set[str]:
    """The mixprec modules ``module`` imports, at module level or inside functions
    (``TYPE_CHECKING`` blocks aside): ``from a import b`` is ``a.b`` where that is a
    module, else ``a``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def known(name: str) -> str:
        while name not in MODULES:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(known(a.name) for a in node.names if a.name.startswith("mixprec"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.startswith("mixprec"):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else known(base))
    return found - {module}


def import_cycles() -> list[list[str]]:
    """Every cycle of imports among mixprec's modules, as the modules of each strongly
    connected part of the import graph (Tarjan's algorithm)."""
    graph = {m: _imports_of(m) for m in MODULES}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in graph:
        if v not in order:
            visit(v)
    return cycles


def test_the_import_graph_has_no_cycles():
    # A cycle is held up by a lazy import somewhere, and breaks when someone tidies it.
    assert _imports_of("mixprec.optim._loss_scale_optimizer") >= {"mixprec.optim.masters"}
    assert import_cycles() == []


def test_private_modules_have_no_all():
    # What a private module offers is its package's business: the package's __init__
    # re-exports the public names and sets __all__.
    private = [m for m, p in MODULES.items() if p.name.startswith("_") and
               p.name not in ("__init__.py", "__main__.py")]  # fmt: skip
    assert [m for m in private if "__all__" in {
        t.id for node in ast.parse(MODULES[m].read_text()).body if isinstance(node, ast.Assign)
        for t in node.targets if isinstance(t, ast.Name)
    }] == []


def test_the_optimizer_wrapper_names_no_master_weight_mode():
    # LossScaleOptimizer reaches the modes through the Masters protocol and the registry
    # only: no class of a mode, no mode's name.
    from mixprec.optim.masters import MODES

    text = (SRC / "optim" / "_loss_scale_optimizer.py").read_text()
    classes = {"MasterWeights", "SplitMasterWeights", "Split8MasterWeights", "LeanUpdates",
               "ModelParameters"}  # fmt: skip
    code = ast.parse(text)
    names = {n.id for n in ast.walk(code) if isinstance(n, ast.Name)}
    strings = {n.value for n in ast.walk(code) if isinstance(n, ast.Constant)}
    assert not names & classes
    assert not strings & set(MODES)
