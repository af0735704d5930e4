"""A griffe extension for the API reference: mixprec's docstrings read well as Markdown.

The docstrings are written for ``help()`` and doctest: ``>>>`` examples in running
text, reST roles (``:class:`Policy```) and ``::`` literal blocks. Markdown would
read an example's output such as ``['a', 'b'][0]`` as a reference link, so each run
of doctest lines becomes a fenced ``pycon`` block, a role becomes inline code, and a
``::`` ending a line becomes ``:`` (the indented block after it is code in Markdown
too). Only the rendered text changes; the docstrings themselves stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


def _code_span(match: re.Match[str]) -> str:
    return f"`{match.group(1)}`"


def markdown_docstring(text: str) -> str:
    """``text`` with doctest runs fenced, roles as code and ``::`` as ``:``.

    >>> markdown_docstring("Use :class:`~a.B`::\\n\\n>>> [1][0]\\n1").splitlines()
    ['Use `a.B`:', '', '```pycon', '>>> [1][0]', '1', '```']
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            # A doctest example runs to the next blank line: prompts, continuations, output.
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        line = _ROLE.sub(_code_span, line)
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
            if not line.strip(":").strip():
                line = ""
        out.append(line)
        i += 1
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrites each loaded object's docstring with :func:`markdown_docstring`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
