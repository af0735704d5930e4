#!/usr/bin/env bash
# One run on a GPU machine: install, versions, the CUDA tests, then the GPU benchmark.
#
#   OUT=/path/to/results bash benchmarks/gpu_run.sh     # from the repository root
#
# Needs python3 with a CUDA build of torch; no network (the install is --no-index).
# Writes under $OUT: install.log, versions.log, tests.log, bench.log,
# gpu_results.json and gpu_results.md. The whole run stays within TOTAL_S seconds
# (default 520): the benchmark's time budget is what the steps before it left,
# minus a margin for its hard deadline (the budget plus 10 %), at most 420 s.
# Set BUDGET_S to fix the budget instead; SIZE=smoke is a quick dry run (also on a CPU).

set -u -o pipefail
: "${OUT:?set OUT to the folder for the logs and results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL_S=${TOTAL_S:-520}
SIZE=${SIZE:-full}
START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }

echo "== install (log: $OUT/install.log)"
if timeout 120 python3 -m pip install --no-index --no-deps --no-build-isolation -e . \
    >"$OUT/install.log" 2>&1; then
    echo "installed mixprec in editable mode"
else
    echo "pip install failed (see install.log); using PYTHONPATH"
fi
# The working tree first either way, so the code measured is the code checked out.
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== versions"
{
    python3 - <<'EOF'
import platform, torch, mixprec
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| mixprec", mixprec.__version__, mixprec.__file__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"capability {p.major}.{p.minor}",
          "| bf16", torch.cuda.is_bf16_supported(), "| devices", torch.cuda.device_count())
else:
    print("NO CUDA DEVICE: torch.cuda.is_available() is False")
EOF
    python3 -m pip list 2>/dev/null | grep -i -E '^(torch|triton|numpy|pytest|hypothesis|nvidia-cu)' || true
    nvidia-smi || echo "nvidia-smi failed"
} 2>&1 | tee "$OUT/versions.log"

# pyproject.toml's addopts already give -q (a second -q would hide the counts line).
echo "== tests (log: $OUT/tests.log) at $(elapsed) s"
timeout -k 10 150 python3 -m pytest -p no:cacheprovider -x -rs \
    tests/test_gpu.py tests/test_core_api.py tests/test_grad_scaler.py 2>&1 | tee "$OUT/tests.log"
TESTS_RC=$?

LEFT=$((TOTAL_S - $(elapsed)))
# The benchmark may run to its budget plus 10 % (hard deadline), then needs a few
# seconds to write; the outer timeout is a last resort 60 s past the budget.
if [ -n "${BUDGET_S:-}" ]; then
    BUDGET=$BUDGET_S
else
    BUDGET=$(((LEFT - 70) * 10 / 11))
    if [ "$BUDGET" -gt 420 ]; then BUDGET=420; fi
    if [ "$BUDGET" -lt 60 ]; then BUDGET=60; fi
fi
echo "== benchmark (log: $OUT/bench.log) at $(elapsed) s, budget $BUDGET s"
timeout -s INT -k 15 $((BUDGET + 60)) \
    python3 -m benchmarks.gpu --out "$OUT" --size "$SIZE" --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench.log"
BENCH_RC=$?

echo "== done at $(elapsed) s: tests exit $TESTS_RC ($(tail -n 1 "$OUT/tests.log")), benchmark exit $BENCH_RC"
ls -l "$OUT"
