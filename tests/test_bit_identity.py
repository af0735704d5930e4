"""Training computes, bit for bit, what the recorded baseline says it computed.

:mod:`benchmarks.bit_identity` trains a grid of tiny models through the public API and
hashes every bit of the result; ``benchmarks/results/bit_identity_baseline.json`` holds
the hashes of a reference build. The quick subset runs here in-process; the full grid
(and the compiled fused steps, when the baseline has them) are marked slow. Results
depend on the CPU's kernels, so a machine other than the baseline's (torch version, CPU
capability, oneDNN bfloat16 support) skips instead of failing. Re-record with
``python -m benchmarks bit_identity --record benchmarks/results/bit_identity_baseline.json
--fused`` only when a change of the numbers is intended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import bit_identity

BASELINE = Path(__file__).resolve().parents[1] / "benchmarks/results/bit_identity_baseline.json"


def _baseline() -> dict[str, Any]:
    """The recorded baseline; the test skips on a machine other than its own."""
    if not BASELINE.is_file():
        pytest.skip(f"no baseline at {BASELINE.name}")
    baseline = json.loads(BASELINE.read_text())
    here = bit_identity.machine()
    if baseline["machine"] != here:
        pytest.skip(
            f"the baseline was recorded on {baseline['machine']}, this machine is {here}: "
            "floating-point results differ between machines for that reason alone"
        )
    return baseline


def _assert_identical(cases: list[bit_identity.Case]) -> None:
    baseline = _baseline()
    results = bit_identity.run_grid(cases)
    _, differ, missing = bit_identity.compare(baseline, results)
    assert not missing, f"not in the baseline: {missing}"
    assert not differ, [
        f"{case_id}: {bit_identity.difference(baseline['cases'][case_id], results[case_id])}"
        for case_id in differ
    ]


def test_the_quick_subset_is_bit_identical_to_the_baseline() -> None:
    _assert_identical(bit_identity.grid(quick=True))


@pytest.mark.slow
def test_the_full_grid_is_bit_identical_to_the_baseline() -> None:
    _assert_identical(bit_identity.grid())


@pytest.mark.slow
def test_the_compiled_fused_steps_are_bit_identical_to_the_baseline() -> None:
    fused = [c for c in bit_identity.grid(fused=True) if c.fused]
    if not set(c.id for c in fused) <= set(_baseline()["cases"]):
        pytest.skip("the baseline was recorded without --fused")
    _assert_identical(fused)


def test_the_digest_sees_one_bit_of_a_parameter_and_the_sign_of_zero() -> None:
    case = next(c for c in bit_identity.grid(quick=True) if c.api == "level")
    first = bit_identity.run_case(case)
    assert bit_identity.run_case(case) == first  # deterministic in one process
    digest = bit_identity._digest
    x = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    nudged = x.clone()
    nudged[0] = 1.0 + 2.0**-7  # bfloat16's next value above 1: one bit of the mantissa
    assert digest(x) != digest(nudged)
    assert digest(x) != digest(torch.tensor([1.0, -0.0], dtype=torch.bfloat16))
    assert digest(x) != digest(x.float())  # the dtype is part of it
    assert digest({"a": x, "b": 1}) == digest({"b": 1, "a": x})  # key order is not


def test_a_refused_combination_is_recorded_as_its_error() -> None:
    case = bit_identity.Case("level", "fp16", "adamw_foreach", level="O2", master_weights="split8")
    record = bit_identity.run_case(case)
    assert record["error"].startswith("error: ValueError: master_weights='split8'")
