"""``benchmarks.lean``: the modes of a seed train in lockstep, and that changes nothing."""

from __future__ import annotations

import pytest
import torch

from benchmarks import lean

pytestmark = pytest.mark.usefixtures("one_thread")


def _alone(mode: str, seed: int, steps: int, lr: float, width: int) -> float:
    case, model, _ = lean._trainer(mode, seed, lr, width, lean._inputs(mode, seed))
    for _ in range(steps):
        case.prepare()
        case.run()
    return lean._final_loss(model, seed)


def test_lockstep_training_gives_each_mode_its_own_results_and_paired_times():
    steps, lr, width = 4, 2e-3, 16
    result = lean.run(steps, 2, lr, width, modes=("fp32", "kahan", "split8"))
    rows = result["modes"]
    for mode in ("fp32", "kahan", "split8"):
        # Stepping beside other modes is stepping alone: nothing leaks between them.
        assert rows[mode]["loss_per_seed"] == [_alone(mode, s, steps, lr, width) for s in (0, 1)]
        low, high = rows[mode]["step_time_quartiles"]
        assert 0 < low <= rows[mode]["step_time_vs_fp32_masters"] <= high
    assert rows["fp32"]["step_time_vs_fp32_masters"] == 1.0
    # fp32 masters: 2 (bfloat16 weight) + 4 (master) + 8 (AdamW); kahan 2 + 2 + 4; split8 2 + 1 + 8.
    assert [round(rows[m]["bytes_per_param"]) for m in ("fp32", "kahan", "split8")] == [14, 8, 11]
    assert rows["split8"]["loss_mean"] != rows["kahan"]["loss_mean"]


def test_a_mode_whose_library_is_missing_is_a_skipped_row(monkeypatch):
    real_import = __import__

    def no_optimi(name, *args, **kwargs):
        if name == "optimi":
            raise ImportError("No module named 'optimi'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_optimi)
    rows = lean.run(2, 1, 2e-3, 16, modes=("fp32", "optimi-kahan"))["modes"]
    assert "optimi" in rows["optimi-kahan"]["skipped"]
    assert rows["fp32"]["step_time_vs_fp32_masters"] == 1.0
    assert torch.isfinite(torch.tensor(rows["fp32"]["loss_mean"]))
