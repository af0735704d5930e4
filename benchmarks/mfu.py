"""Workload 6: model FLOP utilisation of the transformer step against a measured matmul rate.

The matrix rate is measured in the same run: a square matrix product (n = 8192
on a GPU, 2048 on a CPU) repeated and timed, ``2 n^3 / t``, in bfloat16 (plus
float16 on a GPU and float32 everywhere, for context). The transformer step's
FLOPs (forward and backward of the workload-3 transformer on its batch) are
counted by ``torch.utils.flop_counter.FlopCounterMode``, which sees every matrix
product (linear layers, attention) and nothing else. Then for each recipe of
workload 3::

    achieved = step_flops / median step time
    MFU      = achieved / measured bfloat16 matmul rate (float16 on a GPU without bfloat16)

The GPU is the point of this workload (the suite runs it there on its own
device); the CPU numbers come for free and say how far the CPU step is from its
own matrix units.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._common import Preset, device_sync, low_dtypes, workload_main
from benchmarks.recipes import DTYPE_NAMES, workload_model
from benchmarks.throughput import batch_for

__all__ = ["matmul_rate", "transformer_step_flops", "run"]


def matmul_rate(device: str, dtype: torch.dtype, n: int, min_seconds: float = 0.5) -> float:
    """FLOP/s of ``a @ b`` for ``n x n`` matrices of ``dtype``, timed for about ``min_seconds``."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    sync = device_sync(device)
    for _ in range(2):
        a @ b
    sync()
    start = time.perf_counter()
    a @ b
    sync()
    one = max(time.perf_counter() - start, 1e-6)
    reps = max(3, int(min_seconds / one))
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2.0 * n**3 * reps / (time.perf_counter() - start)


def transformer_step_flops(preset: Preset, device: str) -> float:
    """FLOPs of one forward + backward of the workload-3 transformer on its batch."""
    x, y = batch_for("transformer", preset, device)
    torch.manual_seed(0)
    model = workload_model("transformer", preset.transformer).to(device)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return float(counter.get_total_flops())


def run(
    preset: Preset, device: str = "cpu", throughput: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Matmul rates, the step's FLOPs, and MFU of each transformer recipe in ``throughput``."""
    on_gpu = torch.device(device).type == "cuda"
    n = preset.matmul_size_gpu if on_gpu else preset.matmul_size
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if on_gpu else [])
    rates = {DTYPE_NAMES[dt]: matmul_rate(device, dt, n) for dt in dtypes}
    flops = transformer_step_flops(preset, device)
    # The bfloat16 rate, or float16 on a GPU without bfloat16 units.
    peak_dtype = "bfloat16" if torch.bfloat16 in low_dtypes(device) else "float16"
    peak = rates[peak_dtype]
    rows = []
    for group in (throughput or {}).get("groups", []):
        if group["model"] != "transformer" or group["device"] != device:
            continue
        for row in group["rows"]:
            achieved = flops / row["median_s"]
            rows.append(
                {
                    "dtype": "float32" if row["recipe"] == "fp32" else group["dtype"],
                    "recipe": row["recipe"],
                    "achieved_tflops": achieved / 1e12,
                    "mfu": achieved / peak,
                }
            )
    return {
        "device": device,
        "matmul_n": n,
        "matmul_tflops": {k: v / 1e12 for k, v in rates.items()},
        "transformer_step_gflop": flops / 1e9,
        "mfu_reference": f"{peak_dtype} matmul",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    workload_main(__doc__, run, argv, "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
