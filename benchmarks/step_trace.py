"""Step trace: which of the library's Python functions one training step runs.

::

    python -m benchmarks step_trace                  # O2 bfloat16, AdamW, small transformer
    python -m benchmarks step_trace --model mlp --level lean
    python -m benchmarks step_trace --json OUT.json  # every name and count as JSON

What it measures: with ``sys.setprofile``, the distinct named Python functions defined
in the ``mixprec`` package that run during one steady-state training step (after two
warm-up steps): the forward pass with the amp level's module hooks, the loss,
``opt.scale_loss(loss).backward()``, ``opt.step()`` and ``opt.zero_grad()``. Beside it,
the reference: the same model under ``torch.autocast`` with ``torch.amp.GradScaler``
(``scale(loss).backward()``, ``step``, ``update``, ``zero_grad``), counting the
functions defined in ``torch.amp``. Each list gives ``module:qualified name``, the
number of calls and the phases (forward, backward, step, zero_grad) it ran in.

The count is of host-side Python machinery, a proxy for the per-step overhead and for
how much code a step's behaviour depends on; it says nothing about kernels. Lambdas and
comprehensions (names in angle brackets) are counted apart. The models are plain torch
modules, so none of their own code is counted. ``--src DIR`` imports mixprec from
``DIR`` (to compare two checkouts).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Trace", "trace_mixprec_step", "trace_autocast_step", "main"]

PHASES = ("forward", "backward", "step", "zero_grad")
WARMUP = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Trace:
    """Calls of the Python functions whose module is in ``packages``, by phase."""

    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages = packages
        self.calls: collections.Counter[str] = collections.Counter()
        self.phases: dict[str, set[str]] = collections.defaultdict(set)
        self._phase = ""
        self._mine: dict[types.CodeType, str | None] = {}  # code -> its name, or None

    def _name(self, frame: types.FrameType) -> str | None:
        code = frame.f_code
        if code not in self._mine:
            module = frame.f_globals.get("__name__", "")
            ours = any(module == p or module.startswith(p + ".") for p in self.packages)
            qualname = getattr(code, "co_qualname", code.co_name)  # Python 3.11+ knows the class
            self._mine[code] = f"{module}:{qualname}" if ours else None
        return self._mine[code]

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and (name := self._name(frame)) is not None:
            self.calls[name] += 1
            self.phases[name].add(self._phase)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Trace the calls made inside, as phase ``name``. The autograd engine runs a CPU
        backward (and the module hooks it calls) on this thread, so they are seen too."""
        self._phase = name
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)

    def named(self) -> list[str]:
        """The distinct named functions (not lambdas or comprehensions), sorted."""
        return sorted(n for n in self.calls if "<" not in n.split(":", 1)[1])

    def anonymous(self) -> list[str]:
        return sorted(n for n in self.calls if "<" in n.split(":", 1)[1])

    def summary(self) -> dict[str, Any]:
        named = self.named()
        return {
            "distinct_named": len(named),
            "calls_named": sum(self.calls[n] for n in named),
            "distinct_anonymous": len(self.anonymous()),
            "calls_anonymous": sum(self.calls[n] for n in self.anonymous()),
            "per_phase_distinct": {p: sum(p in self.phases[n] for n in named) for p in PHASES},
            "functions": {
                n: {"calls": self.calls[n], "phases": [p for p in PHASES if p in self.phases[n]]}
                for n in named + self.anonymous()
            },
        }


def _model(kind: str) -> nn.Module:
    """Plain torch modules (their own code is not the library's)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10))

    class Transformer(nn.Module):  # 2 encoder layers, d_model 64: the step-cost benchmark's size
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 64)
            layer = nn.TransformerEncoderLayer(
                64, 4, dim_feedforward=128, dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(64)
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.encoder(self.embed(x)).mean(dim=1)))

    return Transformer()


def _batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g) if kind == "mlp" else torch.randn(4, 16, 8, generator=g)
    return x, torch.randint(0, 10, (4,), generator=g)


def _steps(step: Callable[[Trace | None], None], trace: Trace) -> Trace:
    for _ in range(WARMUP):
        step(None)
    step(trace)
    return trace


@contextmanager
def _maybe(trace: Trace | None, phase: str) -> Iterator[None]:
    if trace is None:
        yield
    else:
        with trace.phase(phase):
            yield


def trace_mixprec_step(model_kind: str, level: Any, dtype: torch.dtype, fused: bool) -> Trace:
    """One steady-state step at an amp ``level``, tracing mixprec's functions."""
    from mixprec import amp

    model = _model(model_kind)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    model, opt = amp.initialize(model, inner, level=level, dtype=dtype)
    x, y = _batch(model_kind)
    loss_fn = nn.CrossEntropyLoss()

    def step(trace: Trace | None) -> None:
        with _maybe(trace, "forward"):
            loss = loss_fn(model(x), y)
        with _maybe(trace, "backward"):
            opt.scale_loss(loss).backward()
        with _maybe(trace, "step"):
            opt.step()
        with _maybe(trace, "zero_grad"):
            opt.zero_grad()

    return _steps(step, Trace(("mixprec",)))


def trace_autocast_step(model_kind: str, dtype: torch.dtype, fused: bool) -> Trace:
    """The reference: ``torch.autocast`` + ``torch.amp.GradScaler``, tracing torch.amp."""
    model = _model(model_kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batch(model_kind)
    loss_fn = nn.CrossEntropyLoss()

    def step(trace: Trace | None) -> None:
        with _maybe(trace, "forward"):
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
            loss = loss_fn(out.float(), y)
        with _maybe(trace, "backward"):
            scaler.scale(loss).backward()
        with _maybe(trace, "step"):
            scaler.step(opt)
            scaler.update()
        with _maybe(trace, "zero_grad"):
            opt.zero_grad()

    return _steps(step, Trace(("torch.amp",)))


def _print(title: str, summary: dict[str, Any]) -> None:
    phases = ", ".join(f"{p} {n}" for p, n in summary["per_phase_distinct"].items())
    print(f"{title}: {summary['distinct_named']} distinct named functions, "
          f"{summary['calls_named']} calls ({phases}); plus "
          f"{summary['distinct_anonymous']} lambdas/comprehensions, "
          f"{summary['calls_anonymous']} calls")  # fmt: skip
    for name, entry in summary["functions"].items():
        print(f"  {entry['calls']:4d}  {name}  [{', '.join(entry['phases'])}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks step_trace",
        description="Count the library's Python functions run by one training step.",
    )
    parser.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    parser.add_argument("--level", default="O2", help="amp level (default O2)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    parser.add_argument("--json", metavar="OUT", help="write the names and counts here")
    parser.add_argument("--src", metavar="DIR", help="import mixprec from DIR")
    args = parser.parse_args(argv)
    if args.src:
        if "mixprec" in sys.modules:
            parser.error("--src: mixprec is already imported in this process")
        sys.path.insert(0, str(Path(args.src).resolve()))
    import mixprec

    print(f"mixprec {mixprec.__version__} from {Path(mixprec.__file__).parent}", file=sys.stderr)
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    optimizer = "AdamW(fused=True)" if args.fused else "AdamW"
    ours = trace_mixprec_step(args.model, args.level, dtype, args.fused).summary()
    reference = trace_autocast_step(args.model, dtype, args.fused).summary()
    where = f"{args.model}, {args.dtype}, {optimizer}, step {WARMUP + 1}"
    _print(f"mixprec amp level {args.level} ({where})", ours)
    print()
    _print(f"torch.autocast + torch.amp.GradScaler, torch.amp functions ({where})", reference)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "src")}  # no paths
        out = {"config": config, "mixprec": ours, "torch_amp": reference}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
