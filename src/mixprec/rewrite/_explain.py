"""Explain a rewritten model: every op's list, colour and reason, and the casts it runs.

``explain(gm)`` reads what the rewrite recorded in the graph's node metadata, so it
works on any module :func:`mixprec.rewrite.rewrite` returned. ``count_casts`` counts
the dtype-conversion kernels a call really runs, for comparisons with ``torch.autocast``.

>>> import torch
>>> from mixprec.rewrite import rewrite
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> report = explain(rewrite(net, torch.randn(2, 4), dtype=torch.bfloat16))
>>> report.summary
'converted 3/3 ops to bfloat16 using 4 casts'
>>> [row.op for row in report.rows if row.colour == "bfloat16" and row.op != "cast"]
['linear', 'relu', 'linear']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.rewrite._lazy import LazyRewrite
from mixprec.rewrite._paint import FLOAT8_REASON

_COLUMNS = ("module", "node", "op", "list", "colour", "reason")


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One op of the rewritten graph."""

    module: str
    node: str
    op: str
    list: str | None
    colour: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """The row as a plain dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RewriteReport:
    """What the rewrite did: a table of ops and a summary line.

    ``str(report)`` is a fixed-width table followed by the summary;
    ``report.to_dict()`` is the same as plain data.

    >>> from mixprec.rewrite import rewrite
    >>> report = explain(rewrite(torch.nn.Linear(2, 2), torch.randn(3, 2), dtype="bf16"))
    >>> report.to_dict()["summary"]
    'converted 1/1 ops to bfloat16 using 2 casts'
    >>> print(str(report).splitlines()[0])
    module  node        op      list   colour    reason
    """

    dtype: str
    level: str
    method: str
    converted: int
    total: int
    casts: int
    rows: tuple[ReportRow, ...]

    @property
    def summary(self) -> str:
        """``"converted N/M ops to <dtype> using K casts"``."""
        return (
            f"converted {self.converted}/{self.total} ops to {self.dtype} using {self.casts} casts"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-serialisable)."""
        return {
            "dtype": self.dtype,
            "level": self.level,
            "method": self.method,
            "converted": self.converted,
            "total": self.total,
            "casts": self.casts,
            "summary": self.summary,
            "rows": [row.to_dict() for row in self.rows],
        }

    def __str__(self) -> str:
        cells = [
            [row.module or "<top>", row.node, row.op, row.list or "-", row.colour, row.reason]
            for row in self.rows
        ]
        widths = [
            max([len(name)] + [len(line[i]) for line in cells]) for i, name in enumerate(_COLUMNS)
        ]
        widths[-1] = len(_COLUMNS[-1])  # the reason is last: no padding needed

        def fmt(line: list[str] | tuple[str, ...]) -> str:
            return "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()

        lines = [fmt(_COLUMNS), fmt(["-" * w for w in widths[:-1]] + ["------"])]
        lines += [fmt(line) for line in cells]
        lines.append(f"{self.summary} (level {self.level!r}, captured by {self.method})")
        return "\n".join(lines)


def explain(graph_module: fx.GraphModule | LazyRewrite) -> RewriteReport:
    """Report on a module returned by :func:`mixprec.rewrite.rewrite`.

    Rows list every float32 op of the original model (with the module that ran
    it, its op name, its list, the dtype it now runs in and why), then the bias
    adds and casts the rewrite added. A lazily rewritten model is reported on the
    graph its last call ran.
    """
    if isinstance(graph_module, LazyRewrite):
        graph_module = graph_module.graph_module
    if not isinstance(graph_module, fx.GraphModule):
        raise TypeError(
            f"graph_module must be a torch.fx.GraphModule returned by mixprec.rewrite.rewrite, "
            f"got {type(graph_module).__name__}"
        )
    info = graph_module.meta.get("mixprec")
    if info is None:
        raise ValueError(
            "graph_module was not produced by mixprec.rewrite.rewrite (it has no rewrite "
            "record); call rewrite(model, example_inputs) first and explain its result"
        )
    rows, cast_rows = [], []
    for node in graph_module.graph.nodes:
        meta = node.meta.get("mixprec")
        if meta is None:
            continue
        if meta["role"] == "cast":
            target = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
            op, colour, listed = "cast", str(target).replace("torch.", ""), None
        elif meta["role"] == "bias-view":
            continue
        else:
            op, colour, listed = meta["op"], meta["colour"], meta["list"]
            if meta["reason"].endswith(FLOAT8_REASON):
                colour = "float8"  # float32 in the graph; its matmuls run in float8
        row = ReportRow(meta["path"], node.name, op, listed, colour, meta["reason"])
        (cast_rows if op == "cast" else rows).append(row)
    rows += cast_rows
    ops = [n for n in graph_module.graph.nodes if n.meta.get("mixprec", {}).get("role") == "op"]
    casts = sum(1 for row in rows if row.op == "cast")
    return RewriteReport(
        dtype=info["dtype"],
        level=info["level"],
        method=info["method"],
        converted=sum(1 for n in ops if n.meta["mixprec"]["colour"] == info["dtype"]),
        total=len(ops),
        casts=casts,
        rows=tuple(rows),
    )


class CastCounter(TorchDispatchMode):
    """Count the dtype-conversion kernels (``aten._to_copy`` changing dtype) that run.

    Ops that return their input unchanged (``x.to(x.dtype)``) launch no kernel and
    are not counted.

    >>> with CastCounter() as counter:
    ...     _ = torch.ones(2).half().float().float()
    >>> counter.count
    2
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.casts: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "overloadpacket", None)
        if packet in (torch.ops.aten._to_copy, torch.ops.aten.to):
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if source is not None and isinstance(out, torch.Tensor) and out.dtype != source.dtype:
                self.count += 1
                self.casts.append((source.dtype, out.dtype))
        return out


def count_casts(
    fn: Callable[..., Any], *args: Any, autocast_dtype: torch.dtype | None = None, **kwargs: Any
) -> int:
    """Number of dtype casts ``fn(*args, **kwargs)`` runs (optionally under CPU/CUDA autocast).

    With ``autocast_dtype`` the call runs inside ``torch.autocast`` for the device of
    the first tensor argument, which is how eager mixed precision would run it.

    >>> lin = torch.nn.Linear(4, 4)
    >>> count_casts(lin, torch.randn(2, 4), autocast_dtype=torch.bfloat16)
    3
    """
    with CastCounter() as counter:
        if autocast_dtype is None:
            fn(*args, **kwargs)
        else:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            device = tensors[0].device.type if tensors else "cpu"
            with torch.autocast(device_type=device, dtype=autocast_dtype):
                fn(*args, **kwargs)
    return counter.count
