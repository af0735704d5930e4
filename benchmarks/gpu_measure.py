"""The measurements behind :mod:`benchmarks.gpu`: matmul rates, step FLOPs, one recipe timed.

Everything here measures one thing and returns plain values; the order, the time
budget and the outputs are :mod:`benchmarks.gpu`'s. On a CPU the same code runs
with a host clock, so the benchmark can be tested without a GPU; what only CUDA
has (peak allocated memory, ``set_sync_debug_mode``, kernel times) is ``None``
there, with a note saying so.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.peers import PEER_RECIPES, build_peer
from benchmarks.recipes import build_recipe
from mixprec.train.models import TransformerClassifier

__all__ = [
    "SIZES",
    "Size",
    "Job",
    "Workload",
    "matmul_rates",
    "step_flops",
    "run_job",
    "free_memory",
    "one_line",
    "timed_calls",
]


@dataclasses.dataclass(frozen=True)
class Size:
    """The transformer, its batch and how long each recipe is timed."""

    name: str
    d_model: int
    num_layers: int
    nhead: int
    dim_feedforward: int
    seq_len: int
    token_dim: int  # input features per token (the model's first Linear maps them to d_model)
    batch: int
    warmup: int  # untimed steps before timing; compiled recipes go on until steps are steady
    steps: int  # timed steps
    matmul_n: int  # side of the square matrices whose product gives the peak rates


SIZES: dict[str, Size] = {
    "full": Size("full", 1024, 12, 16, 4096, 1024, 64, 8, 3, 20, 8192),
    "smoke": Size("smoke", 32, 2, 4, 64, 16, 8, 2, 1, 3, 256),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One recipe of :func:`benchmarks.recipes.build_recipe` in one dtype, eager or compiled."""

    recipe: str
    dtype: torch.dtype
    compiled: bool

    @property
    def label(self) -> str:
        """``"O2 bf16"``, or ``"compile(O2 bf16)"``; the float32 recipe is just ``"fp32"``."""
        short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: ""}[self.dtype]
        base = f"{self.recipe} {short}".strip()
        return f"compile({base})" if self.compiled else base


@dataclasses.dataclass
class Workload:
    """The model factory and the fixed batch every recipe trains on."""

    size: Size
    device: str
    x: torch.Tensor
    y: torch.Tensor

    @classmethod
    def make(cls, size: Size, device: str) -> Workload:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(size.batch, size.seq_len, size.token_dim, generator=g)
        y = torch.randint(0, 10, (size.batch,), generator=g)
        return cls(size, device, x.to(device), y.to(device))

    def model(self) -> nn.Module:
        """A fresh float32 ``TransformerClassifier`` of this size (no dropout: no random masks)."""
        s = self.size
        return TransformerClassifier(
            num_classes=10,
            seq_len=s.seq_len,
            token_dim=s.token_dim,
            d_model=s.d_model,
            nhead=s.nhead,
            num_layers=s.num_layers,
            dim_feedforward=s.dim_feedforward,
            dropout=0.0,
        )

    @property
    def tokens(self) -> int:
        return self.size.batch * self.size.seq_len


def _on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def free_memory(device: str) -> None:
    """Collect garbage and hand cached blocks back, so the next recipe starts clean."""
    gc.collect()
    if _on_cuda(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def matmul_rates(device: str, n: int, repeats: int = 10, warmup: int = 3) -> dict[str, Any]:
    """FLOP/s of one ``n x n`` product per precision: ``2 n^3 / median time`` of ``repeats``.

    CUDA: bfloat16, float16, float32 with TF32 tensor cores (``"tf32"``) and true
    float32. CPU: bfloat16 and float32 (float16 has no CPU matrix units worth timing).
    """
    cases: list[tuple[str, torch.dtype, str]] = [
        ("bfloat16", torch.bfloat16, "highest"),
        ("float32", torch.float32, "highest"),
    ]
    if _on_cuda(device):
        cases[1:1] = [("float16", torch.float16, "highest"), ("tf32", torch.float32, "high")]
    before = torch.get_float32_matmul_precision()
    g = torch.Generator(device=device).manual_seed(0)
    rates: dict[str, float] = {}
    try:
        for name, dtype, precision in cases:
            torch.set_float32_matmul_precision(precision)
            a = torch.randn(n, n, device=device, generator=g).to(dtype)
            b = torch.randn(n, n, device=device, generator=g).to(dtype)
            times = timed_calls(lambda a=a, b=b: a @ b, device, warmup, repeats)
            rates[name] = 2.0 * n**3 / statistics.median(times)
            del a, b
    finally:
        torch.set_float32_matmul_precision(before)
    free_memory(device)
    return {
        "n": n,
        "tflops": {k: v / 1e12 for k, v in rates.items()},
        "method": f"median of {repeats} products after {warmup} untimed, {_clock(device)}",
    }


def _clock(device: str) -> str:
    return "CUDA events" if _on_cuda(device) else "host perf_counter"


def timed_calls(fn: Callable[[], Any], device: str, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn``: CUDA events between consecutive calls, or the host clock.

    Events are recorded between calls without waiting, so the host can queue ahead
    as in training, and a call the host is too slow to feed shows as GPU idle time.
    """
    for _ in range(warmup):
        fn()
    if not _on_cuda(device):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for i in range(repeats):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(repeats)]


def step_flops(work: Workload) -> dict[str, Any]:
    """FLOPs of one training step: the formula, and ``FlopCounterMode``'s count as a check.

    ``6 N T``: each of the ``N`` weights takes part in one multiply-add (2 FLOPs) per
    token forward and two backward (input and weight gradients), over the ``T``
    tokens of the batch; ``N`` counts every parameter but the position embedding (a
    lookup, not a product). ``12 L T s d``: attention scores and weighted sums, ``2 s
    d`` FLOPs each per token and layer forward, three times that with backward. The
    count runs the model on the meta device: no memory, no time.
    """
    s = work.size
    with torch.device("meta"):
        model = work.model()
        x = torch.empty(work.x.shape)
        y = torch.zeros(work.y.shape, dtype=torch.long)
    n_matmul = sum(p.numel() for name, p in model.named_parameters() if name != "pos_embedding")
    formula = 6 * n_matmul * work.tokens + 12 * s.num_layers * work.tokens * s.seq_len * s.d_model
    try:
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x).float(), y).backward()
        counted: int | None = int(counter.get_total_flops())
    except Exception as err:  # the count is a cross-check; the formula stands without it
        counted, note = None, one_line(err)
    else:
        note = None
    return {
        "per_step": float(formula),
        "formula": "6*N*T + 12*L*T*s*d",
        "N_params_in_matmuls": n_matmul,
        "params_total": sum(p.numel() for p in model.parameters()),
        "T_tokens": work.tokens,
        "counted_by_FlopCounterMode": counted,
        "count_error": note,
    }


def _steady_warmup(step: Callable[[], Any], device: str, minimum: int, maximum: int) -> list[float]:
    """Untimed steps: at least ``minimum``, then until two in a row agree within 10 %."""
    times: list[float] = []
    sync = torch.cuda.synchronize if _on_cuda(device) else (lambda: None)
    while len(times) < maximum:
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
        steady = len(times) >= 2 and abs(times[-1] - times[-2]) <= 0.1 * times[-2]
        if len(times) >= minimum and (steady or minimum == maximum):
            break
    return times


def _memory_mib(device: str, stat: Callable[[], int]) -> float | None:
    return stat() / 2**20 if _on_cuda(device) else None


def run_job(job: Job, work: Workload, flops: float, bf16_rate: float) -> dict[str, Any]:
    """Build ``job``'s recipe from fresh weights, warm it up, time it; return its row."""
    device, size = work.device, work.size
    if _on_cuda(device):
        torch.cuda.reset_peak_memory_stats()
    baseline = _memory_mib(device, torch.cuda.memory_allocated)
    counters = _dynamo_counters(reset=True) if job.compiled else None
    start = time.perf_counter()
    if job.recipe in PEER_RECIPES:
        recipe = build_peer(job.recipe, work.model, device, compile_model=job.compiled)
    else:
        recipe = build_recipe(
            job.recipe, work.model, work.x, device, job.dtype, compile_model=job.compiled
        )
    built = time.perf_counter() - start

    def step() -> torch.Tensor:
        return recipe.step(work.x, work.y)

    # Compiled: the first step compiles the forward, the first backward the backward; a
    # recompilation shows as another slow step, so warm-up waits for steady steps.
    if job.compiled:
        warmup = _steady_warmup(step, device, max(size.warmup, 3), size.warmup + 10)
    else:
        warmup = _steady_warmup(step, device, size.warmup, size.warmup)
    probe = next(recipe.model.parameters()).detach().clone()
    losses: list[torch.Tensor] = []
    times = timed_calls(lambda: losses.append(step()), device, 0, size.steps)
    final_loss = float(losses[-1])
    median = statistics.median(times)
    skipped = getattr(recipe.optimizer, "skipped_steps", None)
    row: dict[str, Any] = {
        "build_s": built,
        "warmup_s": warmup,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
        "tokens_per_s": work.tokens / median,
        "achieved_tflops": flops / median / 1e12,
        "mfu": flops / median / bf16_rate,
        "baseline_mib": baseline,
        "peak_mib": _memory_mib(device, torch.cuda.max_memory_allocated),
        "final_loss": final_loss,
        "loss_finite": math.isfinite(final_loss),
        "params_updated": not torch.equal(probe, next(recipe.model.parameters()).detach()),
        "skipped_steps": None if skipped is None else int(skipped),
    }
    del probe  # out of the resident count below (as are the losses)
    losses.clear()
    if row["peak_mib"] is not None:
        row["above_baseline_mib"] = row["peak_mib"] - baseline
        # What the recipe keeps between steps (weights, masters, optimizer state; the
        # step freed the gradients), per parameter of the model.
        n_params = sum(p.numel() for p in recipe.model.parameters())
        resident = torch.cuda.memory_allocated() - baseline * 2**20
        row["resident_bytes_per_param"] = resident / n_params
        row["peak_bytes_per_param"] = row["above_baseline_mib"] * 2**20 / n_params
    if counters is not None:
        row["dynamo"] = _dynamo_counters(reset=False)
    return row


def _dynamo_counters(reset: bool) -> dict[str, Any]:
    """Frames compiled (recompilations included), graphs, graph breaks and their first reasons."""
    from torch._dynamo.utils import counters

    if reset:
        counters.clear()
        return {}
    breaks = counters["graph_break"]
    return {
        "frames": int(counters["frames"].get("total", 0)),
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(breaks.values())),
        "break_reasons": [_reason(text) for text in list(breaks)[:3]],
    }


def _reason(text: str) -> str:
    """A graph break's title and, where dynamo gives one, its explanation line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " - ".join(lines[:2])[:300]


def one_line(err: BaseException) -> str:
    """``"TypeName: first line of the message"``, at most 300 characters."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__
