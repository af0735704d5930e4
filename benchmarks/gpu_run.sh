#!/usr/bin/env bash
# One run on a GPU machine: install, versions, the test suite, the step-cost check, the benchmark.
#
#   OUT=/path/to/results bash benchmarks/gpu_run.sh     # from the repository root
#
# Needs python3 with a CUDA build of torch; no network: the install is --no-index, and
# wheels the machine lacks (FlashOptim, torchao, the pinned transformers, torch-optimi)
# are installed from WHEELS (default .whl/) when that folder exists.
# STAGES picks what runs (default "tests stepcost bench"), so a run can be split over
# calls that share one machine's time limit:
#   tests     the whole suite but the slow tests, CUDA tests included (pytest-xdist when
#             there, TESTS_S seconds at most, default 300)
#   stepcost  python -m benchmarks.gpu_step_cost: the launch and byte estimates against
#             the profiler's kernels
#   hostprof  python -m benchmarks.gpu_host_profile: where each recipe's host time goes
#             (HOSTPROF_ONLY: its --only; HOSTPROF_FLAGS: more flags, e.g. --stacks)
#   bench     python -m benchmarks.gpu --peers $BENCH_FLAGS, within BUDGET_S seconds
#             (default: what TOTAL_S, default 560, leaves, at most 480); BENCH_ONLY: the
#             benchmark's --only (comma-separated recipe labels)
# Writes under $OUT: install.log, versions.log, tests.log, stepcost.log, bench.log,
# gpu_step_cost.{json,md}, gpu_host_profile.{json,md}, gpu_results.{json,md}. SIZE=smoke is a quick dry run.

set -u -o pipefail
: "${OUT:?set OUT to the folder for the logs and results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL_S=${TOTAL_S:-560}
SIZE=${SIZE:-full}
STAGES=${STAGES:-tests stepcost bench}
WHEELS=${WHEELS:-.whl}
START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }

echo "== install (log: $OUT/install.log)"
{
    if [ -d "$WHEELS" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/mixprec-site "$WHEELS"/*.whl && echo "wheels from $WHEELS installed"
    fi
    timeout 120 python3 -m pip install --no-index --no-deps --no-build-isolation -e .
} >"$OUT/install.log" 2>&1 || echo "an install step failed (see install.log)"
# The working tree first, so the code measured is the code checked out.
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/mixprec-site ] && export PYTHONPATH="$PYTHONPATH:/tmp/mixprec-site"

echo "== versions"
{
    python3 - <<'EOF'
import importlib.metadata as md, platform, torch, mixprec
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| mixprec", mixprec.__version__, mixprec.__file__)
for name in ("triton", "transformers", "lightning", "flashoptim", "torchao", "torch-optimi"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"capability {p.major}.{p.minor}",
          "| bf16", torch.cuda.is_bf16_supported(), "| devices", torch.cuda.device_count())
else:
    print("NO CUDA DEVICE: torch.cuda.is_available() is False")
EOF
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
        || echo "nvidia-smi failed"
} 2>&1 | tee "$OUT/versions.log"

TESTS_RC=-
if has_stage tests; then
    echo "== CUDA tests, one process (log: $OUT/tests_cuda.log) at $(elapsed) s"
    timeout -k 10 "${CUDA_TESTS_S:-150}" python3 -m pytest -p no:cacheprovider -o addopts="" \
        -q -rfEs --tb=short tests/test_gpu.py tests/test_gpu_levels.py 2>&1 \
        | tee "$OUT/tests_cuda.log" | tail -n 80
    echo "== tests (log: $OUT/tests.log) at $(elapsed) s"
    WORKERS=()
    python3 -c "import xdist" 2>/dev/null && WORKERS=(-n "${TEST_WORKERS:-8}")
    # pytest-timeout (where installed) turns a hung test into a failure with its traceback;
    # -v streams every result into tests.log, so a run cut short still says what ran.
    PER_TEST=()
    python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout "${TEST_TIMEOUT_S:-90}")
    # One CPU thread per worker: xdist's workers share the cores.
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout -k 10 "${TESTS_S:-300}" \
        python3 -m pytest -p no:cacheprovider -o addopts="" \
        -m "not slow" -v -rfE --tb=line "${WORKERS[@]}" "${PER_TEST[@]}" tests 2>&1 \
        | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|Timeout|[0-9]+ (passed|failed)" | tail -n 80
    TESTS_RC=$?
fi

STEPCOST_RC=-
if has_stage stepcost; then
    echo "== step-cost check (log: $OUT/stepcost.log) at $(elapsed) s"
    SMALL=()
    [ "$SIZE" = smoke ] && SMALL=(--small)
    timeout -k 10 "${STEPCOST_S:-150}" python3 -m benchmarks.gpu_step_cost --out "$OUT" \
        "${SMALL[@]}" 2>&1 | tee "$OUT/stepcost.log"
    STEPCOST_RC=$?
fi

HOSTPROF_RC=-
if has_stage hostprof; then
    echo "== host profile (log: $OUT/hostprof.log) at $(elapsed) s"
    ONLY=()
    [ -n "${HOSTPROF_ONLY:-}" ] && ONLY=(--only "$HOSTPROF_ONLY")
    SMALL=()
    [ "$SIZE" = smoke ] && SMALL=(--size smoke)
    # shellcheck disable=SC2086  # HOSTPROF_FLAGS is a list of flags
    timeout -k 10 "${HOSTPROF_S:-240}" python3 -m benchmarks.gpu_host_profile --out "$OUT" \
        "${SMALL[@]}" "${ONLY[@]}" ${HOSTPROF_FLAGS:-} 2>&1 | tee "$OUT/hostprof.log" | grep -E "^###|host profile:"
    HOSTPROF_RC=$?
fi

BENCH_RC=-
if has_stage bench; then
    if [ -n "${BUDGET_S:-}" ]; then
        BUDGET=$BUDGET_S
    else
        # The benchmark may run to its budget plus 10 % (hard deadline), then writes.
        BUDGET=$((($TOTAL_S - $(elapsed) - 40) * 10 / 11))
        if [ "$BUDGET" -gt 480 ]; then BUDGET=480; fi
        if [ "$BUDGET" -lt 60 ]; then BUDGET=60; fi
    fi
    echo "== benchmark (log: $OUT/bench.log) at $(elapsed) s, budget $BUDGET s"
    ONLY=()
    [ -n "${BENCH_ONLY:-}" ] && ONLY=(--only "$BENCH_ONLY")
    # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
    timeout -s INT -k 15 $((BUDGET + 60)) python3 -m benchmarks.gpu --out "$OUT" --size "$SIZE" \
        --budget-s "$BUDGET" --peers "${ONLY[@]}" ${BENCH_FLAGS:-} 2>&1 | tee "$OUT/bench.log"
    BENCH_RC=$?
fi

echo "== done at $(elapsed) s: tests exit $TESTS_RC, step-cost exit $STEPCOST_RC," \
    "host profile exit $HOSTPROF_RC, benchmark exit $BENCH_RC"
ls -l "$OUT"
