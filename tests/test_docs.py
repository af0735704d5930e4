"""The documentation runs as written and covers the whole public API.

* Every fenced ``python`` block of README.md and docs/ runs, page by page, in order, in
  one namespace per page (a page reads as one session), in a temporary folder. An
  ``output`` block right after a ``python`` block is what that block prints: it is
  compared with the printed text, so shown output comes from a run.
* Other languages are not run, and each fence must name one of ``LANGUAGES``, so a
  block cannot be skipped by a typo or a bare fence. ``python-gpu`` marks the few
  Python blocks that need a CUDA device.
* Every name in the ``__all__`` of every public module is in the API reference
  (docs/reference/): a ``::: module.name`` directive, or, for a name re-exported from
  another public module, a table row linking to where that same object is documented.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pkgutil
import re
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mixprec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

RUN = {"python"}
#: Fence languages that are shown, not run: shell, output, text, config, CUDA-only Python.
SHOWN = {"bash", "console", "text", "output", "toml", "yaml", "python-gpu"}
LANGUAGES = RUN | SHOWN

#: Pages whose blocks take more than a few seconds together (trainers, compiling,
#: float16 convolutions on a CPU):
#: run with ``pytest -m slow``.
SLOW_PAGES = {
    "docs/guides/cli.md",
    "docs/guides/compile.md",
    "docs/guides/diagnostics.md",
    "docs/guides/integrations.md",
}

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass
class Block:
    language: str
    line: int  # 1-based line of the opening fence
    text: str


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, dedented to their fence."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        language = match["info"].strip().split(" ")[0].split("{")[0]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""
        ):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        found.append(Block(language, i + 1, "\n".join(body) + "\n"))
        i = j + 1
    return found


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def pages_with_code() -> list:
    params = []
    for page in PAGES:
        if any(b.language in RUN for b in blocks(page)):
            marks = [pytest.mark.slow] if relative(page) in SLOW_PAGES else []
            params.append(pytest.param(page, id=relative(page), marks=marks))
    return params


def test_every_fence_names_a_known_language():
    unknown = [
        f"{relative(page)}:{b.line}: {b.language or '(none)'}"
        for page in PAGES
        for b in blocks(page)
        if b.language not in LANGUAGES
    ]
    assert not unknown, f"fences must name one of {sorted(LANGUAGES)}: {unknown}"


def test_output_blocks_follow_a_python_block():
    for page in PAGES:
        found = blocks(page)
        for before, block in zip([None, *found], found):
            if block.language == "output":
                assert before is not None and before.language == "python", (
                    f"{relative(page)}:{block.line}: an output block must follow a python block"
                )


def test_gpu_only_blocks_are_few():
    gpu = [b for page in PAGES for b in blocks(page) if b.language == "python-gpu"]
    ran = [b for page in PAGES for b in blocks(page) if b.language in RUN]
    assert len(gpu) <= 3 and len(ran) >= 10 * len(gpu), (len(gpu), len(ran))


@pytest.mark.parametrize("page", pages_with_code())
def test_code_blocks_run(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    module = types.ModuleType("docs_page")  # classes defined in a block live here
    monkeypatch.setitem(sys.modules, "docs_page", module)
    namespace = module.__dict__
    found = blocks(page)
    started = time.perf_counter()
    for block, after in zip(found, [*found[1:], None]):
        if block.language not in RUN:
            continue
        where = f"{relative(page)}:{block.line}"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                exec(compile(block.text, where, "exec"), namespace)
            except Exception as err:
                raise AssertionError(f"the block at {where} failed: {err!r}") from err
        if after is not None and after.language == "output":
            shown = [line.rstrip() for line in after.text.rstrip().splitlines()]
            got = [line.rstrip() for line in printed.getvalue().rstrip().splitlines()]
            assert got == shown, f"the block at {where} printed\n{printed.getvalue()}"
    assert time.perf_counter() - started < 120, f"{relative(page)}: blocks must be tiny"


def test_each_readme_block_runs_alone(tmp_path, monkeypatch):
    """A newcomer copies one block of the README: each runs in a namespace of its own."""
    monkeypatch.chdir(tmp_path)
    page = ROOT / "README.md"
    for block in blocks(page):
        if block.language not in RUN:
            continue
        where = f"{relative(page)}:{block.line}"
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block.text, where, "exec"), {"__name__": "readme_block"})
        except Exception as err:
            raise AssertionError(f"the block at {where} fails alone: {err!r}") from err


def test_every_file_the_pages_name_exists():
    """Paths in prose are not links, so the strict docs build does not check them."""
    named = {(page.name, path) for page in PAGES
             for path in re.findall(r"\b(?:examples|benchmarks|tests)/[\w/]+\.(?:py|sh)\b",
                                    page.read_text(encoding="utf-8"))}  # fmt: skip
    assert named and not [(page, path) for page, path in named if not (ROOT / path).exists()]


def test_readme_keeps_the_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "python -m pytest" in [line.strip() for line in readme]
    assert "python -m pytest" in [line.strip() for line in ci]
    assert any(line.startswith("python -m mkdocs build --strict") for line in ci)


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 14_000, "the README is a landing page: move detail to docs/"
    common_case = text.index("amp.initialize(")
    assert common_case < text.index("## Which API"), "the common case comes first"
    for heading in ("torch.autocast", "Which API", "mixprec train", "Documentation"):
        assert heading in text, heading


# -- the API reference ---------------------------------------------------------------


def public_modules() -> list[str]:
    names = ["mixprec"]
    for info in pkgutil.walk_packages(mixprec.__path__, "mixprec."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def reference() -> tuple[dict[str, set[str]], dict[str, str]]:
    """Per page, the identifiers of its ``:::`` directives; and the re-export rows."""
    directives: dict[str, set[str]] = {}
    rows: dict[str, str] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        directives[page.stem] = set(re.findall(r"^::: (\S+)", text, re.M))
        for name, target in re.findall(
            r"^\| `([\w.]+)` \| \[`[\w.]+`\]\[([\w.]+)\] \|", text, re.M
        ):
            rows[name] = target
    return directives, rows


def test_every_public_name_is_in_the_api_reference():
    directives, rows = reference()
    documented = {ident for idents in directives.values() for ident in idents}
    documented_objects = {id(resolve(ident)) for ident in documented}
    missing = []
    total = 0
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        assert module_name in directives, f"docs/reference/{module_name}.md is missing"
        for name in getattr(module, "__all__", []):
            total += 1
            full = f"{module_name}.{name}"
            obj = getattr(module, name)
            if full in documented:
                continue
            if isinstance(obj, types.ModuleType) and obj.__name__ in directives:
                continue  # a subpackage: its own page
            if full in rows and rows[full] in documented and resolve(rows[full]) is obj:
                continue  # a re-export, linked to where the object is documented
            if (
                full in directives[module_name]
                or id(obj) in documented_objects
                and any(resolve(ident) is obj for ident in directives[module_name])
            ):
                continue  # documented under its defining (lazily imported) module
            missing.append(full)
    assert total > 150
    assert not missing, f"add these to docs/reference/: {missing}"


def test_reference_directives_name_real_objects():
    directives, rows = reference()
    for ident in {i for idents in directives.values() for i in idents} | set(rows.values()):
        resolve(ident)


def test_the_docstring_extension_fences_doctests():
    sys.path.insert(0, str(DOCS))
    try:
        extension = importlib.import_module("griffe_docstrings")
    except ImportError:
        pytest.skip("griffe (the docs extra) is not installed")
    finally:
        sys.path.remove(str(DOCS))
    text = "Use :class:`~mixprec.Policy`::\n\n>>> [1, 2][0]\n1\n\nAfter."
    assert extension.markdown_docstring(text).splitlines() == [
        "Use `mixprec.Policy`:", "", "```pycon", ">>> [1, 2][0]", "1", "```", "", "After.",
    ]  # fmt: skip


@pytest.mark.slow
def test_mkdocs_build_is_strict_and_clean(tmp_path):
    pytest.importorskip("mkdocstrings")
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "reference" / "mixprec.amp" / "index.html").exists()


# -- install hints ----------------------------------------------------------------------


#: Each integration, the library it needs and the extra of pyproject.toml that installs it.
INTEGRATIONS = [
    ("lightning", "lightning", "lightning"),
    ("transformers", "transformers", "hf"),
    ("accelerate", "accelerate", "hf"),
]


def install_hint(monkeypatch, integration: str, library: str) -> str:
    """The ``ImportError`` of ``import mixprec.integrations.<integration>`` where ``library``
    is not installed (an import of it fails, as it does where it is missing)."""
    monkeypatch.setitem(sys.modules, library, None)
    monkeypatch.delitem(sys.modules, f"mixprec.integrations.{integration}", raising=False)
    with pytest.raises(ImportError) as caught:
        importlib.import_module(f"mixprec.integrations.{integration}")
    return str(caught.value)


def test_install_hints_work_from_a_checkout(monkeypatch):
    """The hint named ``pip install "mixprec[lightning]"``, a package that is not published."""
    message = install_hint(monkeypatch, "transformers", "transformers")
    assert "mixprec.integrations.transformers needs the 'transformers' package" in message
    assert '"mixprec[' not in message
    assert 'pip install "transformers>=5.23,<5.24" "accelerate>=1.15,<1.16"' in message
    assert 'pip install -e ".[hf]"' in message


@pytest.mark.parametrize("integration, library, extra", INTEGRATIONS, ids=[i[0] for i in INTEGRATIONS])
def test_install_hints_name_the_pins_of_pyproject(monkeypatch, integration, library, extra):
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = " ".join(f'"{pin}"' for pin in extras[extra])
    message = install_hint(monkeypatch, integration, library)
    assert f"needs the {library!r} package, which is not installed: pip install {pins} " in message
    assert f'(from a mixprec checkout: pip install -e ".[{extra}]")' in message


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to a missing {target}"
