"""Speed of amp levels against float32 and ``torch.autocast``: a measurement, not a test.

:func:`compare_speed` times one training step (forward, backward, optimizer step)
of a transformer encoder for each variant, alternating the variants round by round
so that a change in machine load hits all of them alike, and returns the median
seconds per step. Run it by hand::

    python -c "import sys; sys.path.insert(0, 'tests'); import test_amp_speed as t; t.report(t.compare_speed())"

The test below runs it on a tiny encoder and checks that every variant trains the
same model: equal first-step losses within low-precision tolerance.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mixprec import amp

VARIANTS = ("float32", "autocast", "O1", "O2")


def _encoder(layers: int, d_model: int, heads: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _make_step(
    variant: str, model: nn.Module, x: torch.Tensor, target: torch.Tensor, fused: bool = False
) -> Callable[[], float]:
    """A closure running one training step of ``variant``; returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    if variant in ("float32", "autocast"):

        def step() -> float:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast"):
                out = model(x)
            loss = (out.float() - target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return step
    model, scaled = amp.initialize(model, opt, variant, torch.bfloat16)

    def amp_step() -> float:
        loss = (model(x) - target).square().mean()
        scaled.scale_loss(loss).backward()
        scaled.step()
        scaled.zero_grad(set_to_none=True)
        return loss.item()

    return amp_step


def compare_speed(
    *,
    layers: int = 4,
    d_model: int = 512,
    heads: int = 8,
    seq: int = 128,
    batch: int = 8,
    rounds: int = 5,
    warmup: int = 2,
    variants: Sequence[str] = VARIANTS,
    fused: bool = False,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Median seconds per training step and first-step loss of each variant.

    Every variant starts from the same weights and data. Returns ``{variant:
    {"seconds": median, "best_seconds": fastest round, "cpu_seconds": median
    process CPU time, "first_loss": loss of the first step}}``. On a shared machine
    the fastest round is the least disturbed, and with one thread
    (``torch.set_num_threads(1)``) the CPU time ignores time spent waiting for a core.

    ``fused=True`` uses ``AdamW(fused=True)``. The unfused CPU AdamW allocates two
    temporaries per parameter per step; whether glibc serves them from memory it
    kept or from fresh pages (page faults) depends on the allocator's history, and
    can double the step's cost for one variant and not another. Fused AdamW (or
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set high) takes that
    out of the comparison.
    """
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq, d_model, generator=g)
    target = torch.randn(batch, seq, d_model, generator=g)
    steps = {
        v: _make_step(v, _encoder(layers, d_model, heads, seed), x, target, fused) for v in variants
    }
    result = {v: {"first_loss": steps[v]()} for v in variants}
    for _ in range(max(warmup - 1, 0)):
        for v in variants:
            steps[v]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[v]()
            times[v].append(time.perf_counter() - start)
            cpu[v].append(time.process_time() - start_cpu)
    for v in variants:
        result[v]["seconds"] = statistics.median(times[v])
        result[v]["best_seconds"] = min(times[v])
        result[v]["cpu_seconds"] = statistics.median(cpu[v])
    return result


def report(result: dict[str, dict[str, float]]) -> None:
    """Print median and best seconds per step and their ratios to float32 (lower is faster)."""
    base = result.get("float32")
    for variant, r in result.items():
        line = f"{variant:9s} median {r['seconds'] * 1000:8.1f} ms  best {r['best_seconds'] * 1000:8.1f} ms"
        line += f"  cpu {r['cpu_seconds'] * 1000:8.1f} ms"
        if base:
            line += "  ratio to float32: " + ", ".join(
                f"{key.split('_')[0]} {r[key] / base[key]:.3f}"
                for key in ("seconds", "best_seconds", "cpu_seconds")
            )
        print(line)


def test_every_variant_trains_the_same_model():
    result = compare_speed(layers=2, d_model=32, heads=4, seq=8, batch=2, rounds=1, warmup=1)
    assert set(result) == set(VARIANTS)
    reference = result["float32"]["first_loss"]
    for variant, r in result.items():
        assert r["seconds"] > 0
        assert abs(r["first_loss"] - reference) < 0.05 * reference, (variant, r, reference)
